"""Anchor sampling and the one attention mask of DFlash training.

A training sequence of T tokens yields N blocks. Block j starts at anchor
position a_j: `[input_ids[a_j], MASK x (B-1)]`, and its slot k predicts
`input_ids[a_j + k]`. At inference the drafter only has target features for
verified positions `< anchor` (the anchor is the bonus token the target has not
processed yet), so in training block j may see context positions `< a_j` and its
own B tokens, nothing else. Seeing position a_j or another block leaks the answer.

Each layer also applies its own rule (`LayerAttention`): sliding layers of the
published drafters are causal inside the block and see only a window of context.

The mask is defined once, as a `mask_mod(b, h, q_idx, kv_idx)` over the key layout
`[context (T) | block 0 (B) | block 1 (B) | ...]`. flex_attention takes it directly;
the dense boolean mask for SDPA is the same function evaluated on an index grid, and
the split path (train/families/dflash/attention.py) evaluates it on the context and own-block keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def anchor_candidates(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions that may start a block: trained on (`loss_mask == 1`) and with a
    whole block inside the sequence (`pos <= len - B`)."""
    if loss_mask.dim() != 1:
        raise ValueError(f"loss_mask must be 1-D [T], got shape {tuple(loss_mask.shape)}")
    length = loss_mask.shape[0]
    allowed = loss_mask.bool().clone()
    allowed[max(length - block_size + 1, 0) :] = False
    return allowed.nonzero().flatten()


def has_anchor(block_size: int, loss_mask: torch.Tensor) -> bool:
    """Whether a sequence of this loss mask can start one block (the loader's filter)."""
    return anchor_candidates(loss_mask, block_size).numel() > 0


def sample_anchors(
    loss_mask: torch.Tensor,
    block_size: int,
    num_anchors: int = 512,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Up to `num_anchors` distinct anchor positions, sorted, drawn without
    replacement from `anchor_candidates`. Pass one seeded generator for the whole
    run so the anchors are redrawn every step yet reproducible. Returns int64 [N]
    on loss_mask's device (N may be 0 for a sequence with nothing to train on); the
    trainer passes the mask on the host, so drawing them waits on no GPU work."""
    candidates = anchor_candidates(loss_mask.cpu(), block_size)
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values.to(loss_mask.device)


@dataclass(frozen=True)
class LayerAttention:
    """How one drafter layer attends, as z-lab's reference (`dflash` 0.1.0) reads it
    from config: a `sliding_attention` layer is causal (unless the config sets
    `is_causal`) and sees keys less than `window` positions away; a
    `full_attention` layer is bidirectional with no window (see
    `DrafterConfig.layer_attention`). Hashable: layers with the same rule share a mask."""

    causal: bool = False
    window: int | None = None

    def allows(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """The reference's per-layer rule on absolute positions: causal means
        key <= query; a window means query - key < window and, when not causal,
        key - query < window too."""
        offset = query_pos - key_pos
        visible = offset >= 0 if self.causal else torch.ones_like(offset, dtype=torch.bool)
        if self.window is not None:
            visible = visible & (offset < self.window)
            if not self.causal:
                visible = visible & (-offset < self.window)
        return visible


FULL_ATTENTION = LayerAttention()


def dflash_mask_mod(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, rule: LayerAttention = FULL_ATTENTION
) -> MaskMod:
    """The DFlash training mask as a flex_attention `mask_mod`: the one owner of
    who-sees-what in training (the dense mask and the split path evaluate it too).

    Query q is slot q % B of block j = q // B, at position a_j + q % B. It may
    attend key kv when kv is a context position strictly before a_j, or kv is a
    slot of block j itself (never another block), and the layer's `rule` allows
    the pair of absolute positions (causal / window, as in the reference)."""

    last_block = max(anchor_positions.numel() - 1, 0)
    num_queries = anchor_positions.numel() * block_size
    if anchor_positions.numel() == 1:  # two entries (never read past last_block): torch.compile specialises size 1
        anchor_positions = anchor_positions.repeat(2)

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchor_positions[block.clamp(max=last_block)]  # clamp: flex pads q_idx
        in_context = kv_idx < context_len
        sees_context = in_context & (kv_idx < anchor)
        same_block = ~in_context & ((kv_idx - context_len) // block_size == block)
        key_pos = torch.where(in_context, kv_idx, anchor + (kv_idx - context_len) % block_size)
        visible = (sees_context | same_block) & rule.allows(anchor + q_idx % block_size, key_pos)
        return visible & (q_idx < num_queries)  # a padded query sees nothing (train.families.dflash.flex_mask)

    return mask_mod


def dense_attention_mask(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, rule: LayerAttention = FULL_ATTENTION
) -> torch.Tensor:
    """Boolean mask [N*B, T + N*B] (True = may attend) for SDPA: `dflash_mask_mod`
    evaluated on every (query, key) pair."""
    num_queries = anchor_positions.numel() * block_size
    device = anchor_positions.device
    q_idx = torch.arange(num_queries, device=device)[:, None]
    kv_idx = torch.arange(context_len + num_queries, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return dflash_mask_mod(anchor_positions, context_len, block_size, rule)(zero, zero, q_idx, kv_idx)


def block_position_ids(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute RoPE positions of the block tokens, [N, B]: anchor .. anchor+B-1."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return anchor_positions[:, None] + offsets[None, :]
