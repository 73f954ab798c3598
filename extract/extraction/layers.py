"""Context layer ids for an extraction job: which target layers' hidden states the
store keeps.

The rule itself (convention, default spread, validity) is owned by
`store_schema.layout`, because the store records the ids with their convention and
the trainer reads them back: id ``L`` is the *output* of decoder layer ``L``
(0-based), i.e. transformers' ``hidden_states[L + 1]``, before the final norm.
This module resolves a job's ids from the command line and the target's config.
"""

from __future__ import annotations

from pathlib import Path

from store_schema.layout import default_layer_ids, drafter_layer_ids, validate_layer_ids
from store_schema.runtime.target_config import TargetConfig, read_target_config


def parse_layer_ids(text: str) -> list[int]:
    """Parse ``"1,9,17"`` from the command line (validation is separate)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--layers wants comma-separated integers, got {text!r}") from None


def layers_from_drafters(text: str) -> dict[str, list[int]]:
    """`--layers-from DIR[,DIR...]`: {directory: the target layers its drafter reads}."""
    directories = [part.strip() for part in text.split(",") if part.strip()]
    if not directories:
        raise ValueError("--layers-from wants drafter directories, comma-separated")
    return {directory: drafter_layer_ids(directory) for directory in directories}


def union_of(sets: dict[str, list[int]]) -> list[int]:
    """Every layer any of the drafters reads, in order: one store serves them all."""
    return sorted({layer for ids in sets.values() for layer in ids})


def resolve_layer_ids(
    target: str | Path | TargetConfig, layer_ids: list[int] | None = None, num_context_layers: int | None = None
) -> list[int]:
    """Explicit ids (validated) or the default spread for ``num_context_layers`` (5 if
    neither), for the target at a model path or as its config already read."""
    config = target if isinstance(target, TargetConfig) else read_target_config(target)
    num_layers = config.num_hidden_layers
    if layer_ids is not None and num_context_layers is not None:
        raise ValueError("give either explicit layer ids or a number of context layers, not both")
    if layer_ids is not None:
        return validate_layer_ids(layer_ids, num_layers)
    return default_layer_ids(num_layers, 5 if num_context_layers is None else num_context_layers)
