"""The two pieces of the target model the trainer needs: its frozen `embed_tokens`
and `lm_head`, read straight from the target's safetensors files.

Why: training runs offline from the hidden-state store, so the 27B target is never
resident. We open the checkpoint with `safetensors.safe_open` and read exactly two
tensors; the target model is never instantiated and nothing is unpickled.

The target's config fields (`TargetConfig`, `read_target_config`) are read by
`store_schema.runtime.target_config`, the one reader of a target's `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from store_schema.runtime.target_config import TargetConfig, read_target_config

# Where the token embedding lives in the checkpoint layouts we know, most common first.
EMBED_NAMES = (
    "model.embed_tokens.weight",  # Qwen3 / Qwen3.5 text-only CausalLM
    "model.language_model.embed_tokens.weight",  # Qwen3.5 / 3.6 multimodal releases
    "language_model.model.embed_tokens.weight",  # older multimodal layout
    "embed_tokens.weight",  # bare decoder
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.language_model.lm_head.weight",
)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index if the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors.index.json or model.safetensors in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    path = files[name]
    if not path.is_file():
        raise FileNotFoundError(f"{name!r} is mapped to {path}, which does not exist")
    with safe_open(str(path), framework="pt") as f:
        if name not in f.keys():
            raise KeyError(f"{path}: tensor {name!r} listed in the index is missing from the file")
        return f.get_tensor(name)


class TargetHead(nn.Module):
    """Frozen `embed_tokens` and `lm_head` of the target. Not part of the drafter's
    checkpoint; the drafter is given it at forward/loss time."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None):
        super().__init__()
        vocab, hidden = embed_weight.shape
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=embed_weight)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if lm_head_weight is None:  # tied embeddings: one tensor, used twice
            self.lm_head.weight = self.embed_tokens.weight
        else:
            if lm_head_weight.shape != embed_weight.shape:
                raise ValueError(
                    f"lm_head {tuple(lm_head_weight.shape)} and embed_tokens {tuple(embed_weight.shape)} "
                    "differ in shape"
                )
            self.lm_head.weight = nn.Parameter(lm_head_weight)
        self.requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]


def load_target_head(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    config: TargetConfig | None = None,
) -> TargetHead:
    """Load the target's frozen embedding and LM head from its safetensors alone.

    Tied checkpoints (`tie_word_embeddings`, possibly in `text_config`) store no
    `lm_head.weight`; the embedding is reused. `config`: the target's config when
    the caller has read it already (default: read here)."""
    model_dir = Path(model_dir)
    config = config or read_target_config(model_dir)
    files = _weight_files(model_dir)
    where = model_dir / (
        "model.safetensors.index.json"
        if (model_dir / "model.safetensors.index.json").is_file()
        else "model.safetensors"
    )

    embed_name = next((n for n in EMBED_NAMES if n in files), None)
    if embed_name is None:
        raise KeyError(f"{where}: no embedding tensor found; looked for {', '.join(EMBED_NAMES)}")
    embed = _read_tensor(files, embed_name)

    head_name = next((n for n in LM_HEAD_NAMES if n in files), None)
    if head_name is not None:
        head = _read_tensor(files, head_name)
    elif config.tie_word_embeddings:
        head = None
    else:
        raise KeyError(
            f"{where}: no lm_head tensor found (looked for {', '.join(LM_HEAD_NAMES)}) "
            "and config.json does not set tie_word_embeddings"
        )

    if embed.shape[0] != config.vocab_size or embed.shape[1] != config.hidden_size:
        raise ValueError(
            f"{where}: {embed_name} has shape {tuple(embed.shape)}, config says vocab {config.vocab_size} "
            f"x hidden {config.hidden_size}"
        )
    if dtype is not None:
        embed = embed.to(dtype)
        head = head.to(dtype) if head is not None else None
    return TargetHead(embed, head).to(device)


def head_topk(hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int, chunk_rows: int = 2048):
    """Top-k logits (as the lm_head computes them, held in fp32) and ids of drafter
    outputs `hidden` [..., H], and each row's logsumexp over the full vocabulary
    (log-probs are logits - logsumexp), a chunk of rows at a time so the full logits
    never exist at once. Returns ([..., k] float32, [..., k] int64, [..., 1] float32)."""
    shape = hidden.shape[:-1]
    rows = hidden.reshape(-1, hidden.shape[-1])
    k = min(k, lm_head_weight.shape[0])
    values = torch.empty(rows.shape[0], k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.long, device=rows.device)
    normalizer = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    for start in range(0, rows.shape[0], chunk_rows):
        logits = F.linear(rows[start : start + chunk_rows].to(lm_head_weight.dtype), lm_head_weight).float()
        top = logits.topk(k, dim=-1)
        values[start : start + chunk_rows] = top.values
        ids[start : start + chunk_rows] = top.indices
        normalizer[start : start + chunk_rows] = torch.logsumexp(logits, dim=-1, keepdim=True)
    return values.view(*shape, k), ids.view(*shape, k), normalizer.view(*shape, 1)
