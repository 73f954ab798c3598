"""The drafter at decode time: one block per round, with the context cached.

The training forward (`DFlashDrafter.forward`) recomputes `fc`/`hidden_norm` and
every layer's context keys/values over the whole sequence for each call. While
decoding, the context only grows (the target's features of newly verified
positions are appended each round), so `DraftCache` keeps, per drafter layer, the
context keys (after `k_norm` and RoPE at their positions) and values of verified
positions `[0, length)`, as z-lab's reference does with its draft-side cache.
`draft(block_ids)` then runs one block `[anchor token, MASK ...]` at positions
`length .. length + b - 1`: queries from the block, keys/values
`[cached context | block]`, each layer under its own rule (`LayerAttention`: full
layers see everything, sliding layers are causal with a window over key
positions, of which only the window's keys are read), the same computation as the
training forward with the anchor at `length` (context strictly before the anchor,
the block's own slots), which `tests/train/test_speculate.py` checks. A DFlash 2
drafter's block-local convolutions see just this block (train/families/dflash/dflash2.py).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from train.families.dflash.anchors import FULL_ATTENTION
from train.families.dflash.attention import attend
from train.families.dflash.model import DFlashDrafter, apply_rope


class DraftCache:
    """Context keys/values of every drafter layer for verified positions [0, length)."""

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Embedding):
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.length = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    def _positions(self, count: int, device) -> torch.Tensor:
        return torch.arange(self.length, self.length + count, device=device)[None]

    @torch.no_grad()
    def extend(self, features: torch.Tensor) -> None:
        """Append the target's context features [n, n_ctx*H] of positions
        length .. length+n-1 (concatenated in `context_layer_ids` order)."""
        drafter = self.drafter
        expected = drafter.config.num_context_layers * drafter.config.hidden_size
        if features.dim() != 2 or features.shape[-1] != expected:
            raise ValueError(f"context features must be [n, {expected}], got {tuple(features.shape)}")
        count = features.shape[0]
        if count == 0:
            return
        context = drafter.hidden_norm(drafter.fc(features.to(self.dtype)))[None]  # [1, n, H]
        cos, sin = drafter.rotary_emb(context, self._positions(count, features.device))
        for i, layer in enumerate(drafter.decoder_layers):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(context).view(1, count, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(context).view(1, count, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            k = apply_rope(k, cos, sin)
            cached_k, cached_v = self.keys[i], self.values[i]
            self.keys[i] = k if cached_k is None else torch.cat([cached_k, k], dim=2)
            self.values[i] = v if cached_v is None else torch.cat([cached_v, v], dim=2)
        self.length += count

    @torch.no_grad()
    def draft(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [b, H] (after `norm`) of the block `block_ids` [b]
        anchored at position `length`; apply the target's lm_head for logits."""
        drafter = self.drafter
        count = block_ids.shape[0]
        x = self.embed_tokens(block_ids).to(self.dtype)[None]  # [1, b, H]
        cos, sin = drafter.rotary_emb(x, self._positions(count, block_ids.device))
        for i, layer in enumerate(drafter.decoder_layers):
            attention = partial(self._attend, layer.self_attn, layer=i, cos=cos, sin=sin)
            x = layer.sublayers(x, attention, count)  # the block drafted is one block of `count` rows
        return drafter.norm(x)[0]

    def _attend(self, attn, x: torch.Tensor, layer: int, cos, sin) -> torch.Tensor:
        count = x.shape[1]
        q = attn.q_norm(attn.q_proj(x).view(1, count, attn.num_heads, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(1, count, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(1, count, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        anchor, rule = self.length, attn.rule
        first = 0 if rule.window is None else max(0, anchor - rule.window + 1)  # older keys are out of every window
        cached_k, cached_v = self.keys[layer], self.values[layer]
        if anchor > first and cached_k is not None and cached_v is not None:
            k = torch.cat([cached_k[:, :, first:], k], dim=2)
            v = torch.cat([cached_v[:, :, first:], v], dim=2)
        mask = None
        if rule != FULL_ATTENTION:
            key_positions = torch.arange(first, anchor + count, device=x.device)
            query_positions = torch.arange(anchor, anchor + count, device=x.device)
            mask = rule.allows(query_positions[:, None], key_positions[None, :])
        out = attend(q, k, v, mask)
        return attn.o_proj(out.transpose(1, 2).reshape(1, count, -1))
