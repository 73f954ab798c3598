"""The flex_attention BlockMask of DFlash training, built from the anchors.

`torch.nn.attention.flex_attention.create_block_mask` evaluates the mask_mod on every
(query, key) pair: at 512 anchors x 16 slots over an 3,072-token context that is an
8,192 x 11,264 grid, ~2 GB of intermediates and 1.6-2.4 s on a CPU, twice per
sequence (one mask per layer rule). The mask's shape is known from the anchors: query
q (slot s of block j, at position a_j + s) sees the context interval
[lo_q, a_j) (lo_q = 0, or past the sliding window) and some of its own block's B keys
(`LayerAttention.allows`). Counting, per query, the keys each 128-key tile holds
costs Q x (KV / 128) instead of Q x KV; summing those counts over each 128-query tile
says which tiles are empty, partial (mask_mod applied) or full, exactly what
`create_block_mask` derives from the dense grid (tests/train/test_drafter.py checks they
are equal). The BlockMask keeps `dflash_mask_mod`, the one rule, for partial tiles.

Lengths are padded to whole tiles, at least two (`padded`): flex's compiled kernels then
always see divisible lengths and no dimension of size 1, one shape class for every
sequence. Padded queries and keys see nothing.
"""

from __future__ import annotations

import torch

from train.families.dflash.anchors import LayerAttention, dflash_mask_mod

FLEX_TILE = 128  # flex_attention's sparse block size (torch's default), queries and keys


def padded(length: int) -> int:
    """`length` rounded up to whole tiles, at least two (a dimension of size 1 would be
    specialised by torch.compile: one more graph)."""
    return max(2, -(-length // FLEX_TILE)) * FLEX_TILE


def visible_key_counts(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, rule: LayerAttention
) -> torch.Tensor:
    """[query tiles, key tiles] int64: how many (query, key) pairs of each tile pair the
    DFlash mask lets through, over the padded lengths."""
    device = anchor_positions.device
    num_queries = anchor_positions.numel() * block_size
    key_tiles = padded(context_len + num_queries) // FLEX_TILE
    query = torch.arange(num_queries, device=device)
    anchor = anchor_positions.long().repeat_interleave(block_size)
    position = anchor + query % block_size
    # context keys: the interval [low, anchor), cut by the window of sliding layers
    low = torch.zeros_like(anchor) if rule.window is None else (position - rule.window + 1).clamp(min=0)
    starts = torch.arange(key_tiles, device=device) * FLEX_TILE
    ends = (starts + FLEX_TILE).clamp(max=context_len)
    counts = (torch.minimum(anchor[:, None], ends[None]) - torch.maximum(low[:, None], starts[None])).clamp(min=0)
    # own-block keys: slot t of block j is key context_len + j*B + t
    slots = torch.arange(block_size, device=device)
    own = rule.allows(position[:, None], anchor[:, None] + slots[None]).long()
    own_keys = context_len + (query // block_size * block_size)[:, None] + slots[None]
    counts.scatter_add_(1, own_keys // FLEX_TILE, own)
    rows = padded(num_queries) - num_queries
    counts = torch.cat([counts, counts.new_zeros(rows, key_tiles)])
    return counts.view(-1, FLEX_TILE, key_tiles).sum(dim=1)


def dflash_block_mask(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, rule: LayerAttention = LayerAttention()
):
    """The BlockMask for `dflash_mask_mod` over the padded query and key lengths."""
    from torch.nn.attention.flex_attention import BlockMask  # torch >= 2.5 only (pyproject allows 2.4)

    counts = visible_key_counts(anchor_positions, context_len, block_size, rule)
    full = counts == FLEX_TILE * FLEX_TILE
    partial = (counts > 0) & ~full
    num_queries = anchor_positions.numel() * block_size
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=dflash_mask_mod(anchor_positions, context_len, block_size, rule),
        seq_lengths=(padded(num_queries), padded(context_len + num_queries)),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per query tile [1, 1, rows], key-tile indices [1, 1, rows, cols]) with the
    selected tiles first in ascending order, as BlockMask stores them."""
    tiles = tiles.to(torch.int32)[None, None]
    indices = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(dim=-1).to(torch.int32), indices.to(torch.int32)
