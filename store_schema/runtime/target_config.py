"""Reading a target model's `config.json`: the one place that knows where the
language model's fields live (flat, or nested under `text_config` in multimodal
releases such as Qwen3.5/3.6) and how rope is spelled (transformers 4
`rope_theta` or transformers 5 `rope_parameters`).

Extraction sizes its job and the store's fingerprint from it; the trainer sizes
the drafter from it. Plain JSON: no transformers import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TargetConfig:
    """The target config fields the cache and the drafter need, flattened out of `text_config`."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    intermediate_size: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int | None = None
    model_type: str | None = None
    rope_parameters: dict = field(default_factory=dict)


def read_config_json(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"target config not found: {path} (is {model_dir} a model directory?)")
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def text_config(config: dict) -> dict:
    """Multimodal releases nest the language model's fields under `text_config`."""
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        return text
    return config


def read_target_config(model_dir: str | Path) -> TargetConfig:
    """`config.json` (transformers 4 or 5 style, flat or nested) as a TargetConfig."""
    path = Path(model_dir) / "config.json"
    config = read_config_json(model_dir)
    text = text_config(config)
    where = "text_config" if text is not config else "top level"

    def need(key: str):
        if text.get(key) is None:
            raise KeyError(f"{path}: target config has no {key!r} (looked in {where})")
        return text[key]

    rope_parameters = dict(text.get("rope_parameters") or {})
    rope_theta = rope_parameters.get("rope_theta", text.get("rope_theta", 10000.0))
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    # Either level may carry the flag in multimodal configs; it only matters when
    # the checkpoint has no lm_head tensor.
    tied = bool(text.get("tie_word_embeddings", False)) or bool(config.get("tie_word_embeddings", False))
    return TargetConfig(
        hidden_size=hidden,
        vocab_size=int(need("vocab_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        intermediate_size=text.get("intermediate_size"),
        tie_word_embeddings=tied,
        max_position_embeddings=text.get("max_position_embeddings"),
        model_type=text.get("model_type"),
        rope_parameters=rope_parameters,
    )
