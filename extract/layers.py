"""Context layer ids: which target layers' hidden states the store keeps.

Convention (stored with the ids, because tools differ by one): id ``L`` is the
*output* of decoder layer ``L`` (0-based), i.e. transformers'
``hidden_states[L + 1]``, before the final norm. The last decoder layer is never
a context layer (its output is what the target's own head reads), so valid ids
are ``0 .. N-2`` for an ``N``-layer target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from store_schema.layout import LAYER_ID_CONVENTION  # noqa: F401  (one wording, stored with the ids)
from store_schema.layout import default_layer_ids as spread_layer_ids


def hidden_states_index(layer_id: int) -> int:
    """Index into transformers' ``output_hidden_states`` tuple for a layer id
    (index 0 there is the embedding output, hence the +1)."""
    return layer_id + 1


def default_layer_ids(num_layers: int, num_context_layers: int) -> list[int]:
    """DFlash's default spread (``store_schema.layout.default_layer_ids``), validated
    for this target."""
    n, N = int(num_context_layers), int(num_layers)
    if n < 1:
        raise ValueError(f"need at least one context layer, got {n}")
    if N < 2:
        raise ValueError(f"a target needs at least 2 decoder layers to have a context layer, got {N}")
    try:
        return validate_layer_ids(spread_layer_ids(N, n), N)
    except ValueError as error:
        raise ValueError(f"cannot spread {n} context layers over a {N}-layer target: {error}") from None


def validate_layer_ids(layer_ids, num_layers: int) -> list[int]:
    """Refuse ids that would silently change what the drafter sees.

    Ids must be ints in ``0 .. N-2``, unique and strictly increasing. Unsorted
    ids are refused rather than sorted: their order is the order the features
    are concatenated into the drafter's ``fc``, and the store, trainer and
    export must all agree on one order, so we only accept the canonical one.
    """
    ids = list(layer_ids)
    if not ids:
        raise ValueError("no context layer ids given")
    for layer_id in ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise ValueError(f"layer id {layer_id!r} is not an integer")
    last = num_layers - 1
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise ValueError(
            f"layer ids {bad} are outside 0..{num_layers - 2} for a {num_layers}-layer target "
            f"(id L = output of decoder layer L, 0-based; the final layer {last} is never a context layer)"
        )
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate layer ids {dupes} in {ids}")
    if ids != sorted(ids):
        raise ValueError(f"layer ids {ids} are not in increasing order; pass {sorted(ids)}")
    return ids


def parse_layer_ids(text: str) -> list[int]:
    """Parse ``"1,9,17"`` from the command line (validation is separate)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--layers wants comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class TargetDims:
    num_layers: int
    hidden_size: int
    vocab_size: int | None


def read_text_config(model_path: str | Path) -> dict:
    """The text model's config from a local ``config.json``; multimodal releases
    (Qwen3.5/3.6 VL layout) nest it under ``text_config``."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_path}")
    config = json.loads(path.read_text())
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    if "num_hidden_layers" not in config:
        raise ValueError(f"{path} has no num_hidden_layers (nor a text_config with one)")
    return config


def target_dims(model_path: str | Path) -> TargetDims:
    config = read_text_config(model_path)
    return TargetDims(int(config["num_hidden_layers"]), int(config["hidden_size"]), config.get("vocab_size"))


def resolve_layer_ids(
    model_path: str | Path, layer_ids: list[int] | None = None, num_context_layers: int | None = None
) -> list[int]:
    """Explicit ids (validated) or the default spread for ``num_context_layers`` (5 if neither)."""
    num_layers = target_dims(model_path).num_layers
    if layer_ids is not None and num_context_layers is not None:
        raise ValueError("give either explicit layer ids or a number of context layers, not both")
    if layer_ids is not None:
        return validate_layer_ids(layer_ids, num_layers)
    return default_layer_ids(num_layers, 5 if num_context_layers is None else num_context_layers)
