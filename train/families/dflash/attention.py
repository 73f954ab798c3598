"""The drafter's training attention, three ways, all from the one mask rule
(`train.families.dflash.anchors.dflash_mask_mod`):

- "split" (the default off CUDA): each query block attends to the context and to
  its own B keys separately, the two score sets concatenated before one softmax,
  in chunks of anchors. The block-to-block part of `[context | every block]` (all
  masked but the diagonal) is never built, and each chunk only touches the
  context columns its rule lets it see (up to its last anchor, within the window).
- "sdpa": one dense SDPA over `[context | every block]` with a materialised
  [N*B, T + N*B] boolean mask. Simple and slow; the reference the others are tested against.
- "flex": flex_attention with a BlockMask built from the anchors
  (`train.families.dflash.flex_mask`), compiled on CUDA (`train.families.dflash.flex_compile`), the default there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.families.dflash.anchors import LayerAttention, dense_attention_mask, dflash_mask_mod
from train.families.dflash.flex_compile import DISABLED, CompiledFlex
from train.families.dflash.flex_mask import dflash_block_mask
from train.families.dflash.geometry import ATTENTION_KINDS

SPLIT_CHUNK_SCORES = 1 << 21  # scores per chunk (all heads) the split path aims for


def resolve_attention(attention: str, device: torch.device) -> str:
    """ "auto" -> flex on CUDA (the fused kernel), split elsewhere; split wherever flex
    was given up in this process (`flex_compile.give_up_flex`)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
    if attention == "auto":
        attention = "flex" if device.type == "cuda" else "split"
    return "split" if attention == "flex" and DISABLED else attention


def compiles_flex(device: torch.device) -> bool:
    """Whether flex_attention runs compiled (the fused kernel) on `device`: CUDA only."""
    return device.type == "cuda"


@dataclass
class SplitChunk:
    """Blocks [start, stop) and the context columns [key_start, key_stop) they may see.
    `blocked`: bool [blocks, B, (key_stop - key_start) + B], True = masked out; the
    last B columns are the block's own slots."""

    start: int
    stop: int
    key_start: int
    key_stop: int
    blocked: torch.Tensor


@dataclass
class SplitMask:
    context_len: int
    block_size: int
    chunks: list[SplitChunk]


def split_mask(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, rule: LayerAttention, num_heads: int
) -> SplitMask:
    """`dflash_mask_mod` evaluated on each chunk's queries x (context keys, own-block keys).
    Chunks hold about SPLIT_CHUNK_SCORES scores; anchors are sorted, so a chunk's
    visible context is a narrow column range."""
    mask_mod = dflash_mask_mod(anchor_positions, context_len, block_size, rule)
    device = anchor_positions.device
    num_blocks = anchor_positions.numel()
    per_block = max(num_heads * block_size * (context_len + block_size), 1)
    blocks_per_chunk = max(1, min(num_blocks, SPLIT_CHUNK_SCORES // per_block))
    zero = torch.zeros((), dtype=torch.long, device=device)
    slots = torch.arange(block_size, device=device)
    chunks = []
    for start in range(0, num_blocks, blocks_per_chunk):
        stop = min(start + blocks_per_chunk, num_blocks)
        q_idx = torch.arange(start * block_size, stop * block_size, device=device).view(-1, block_size, 1)
        context = mask_mod(zero, zero, q_idx, torch.arange(context_len, device=device).view(1, 1, -1))
        columns = context.flatten(0, 1).any(0).nonzero().flatten()
        key_start, key_stop = (int(columns[0]), int(columns[-1]) + 1) if columns.numel() else (0, 0)
        own_keys = (
            context_len + torch.arange(start, stop, device=device).view(-1, 1, 1) * block_size + slots.view(1, 1, -1)
        )
        own = mask_mod(zero, zero, q_idx, own_keys)
        visible = torch.cat([context[..., key_start:key_stop], own], dim=-1)
        chunks.append(SplitChunk(start, stop, key_start, key_stop, ~visible))
    return SplitMask(context_len, block_size, chunks)


def build_attention_mask(
    attention: str,
    anchor_positions: torch.Tensor,
    context_len: int,
    block_size: int,
    rule: LayerAttention,
    num_heads: int,
):
    """The mask object `attend` takes for a resolved attention kind."""
    if attention == "split":
        return split_mask(anchor_positions, context_len, block_size, rule, num_heads)
    if attention == "sdpa":
        return dense_attention_mask(anchor_positions, context_len, block_size, rule)
    if attention == "flex":
        return dflash_block_mask(anchor_positions, context_len, block_size, rule)
    raise ValueError(f"attention must be 'split', 'sdpa' or 'flex' here, got {attention!r}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q [1, heads, N*B, D]; k, v [1, kv_heads, T + N*B, D] laid out [context | blocks];
    mask from `build_attention_mask` (None: every key visible). Returns [1, heads, N*B, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(mask, SplitMask):
        return _split_attention(q, k, v, mask, scale)
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return _flex_attention(q, k, v, mask, scale)


def _split_attention(q, k, v, mask: SplitMask, scale: float) -> torch.Tensor:
    """Each query's scores over [its visible context | its own block], one softmax."""
    _, heads, num_queries, dim = q.shape
    kv_heads, block = k.shape[1], mask.block_size
    groups, num_blocks, context_len = heads // kv_heads, num_queries // block, mask.context_len
    # Query head h uses kv head h // groups (as SDPA's enable_gqa does).
    q = (q[0] * scale).view(kv_heads, groups, num_blocks, block, dim)
    k_context, v_context = k[0, :, :context_len], v[0, :, :context_len]
    k_own = k[0, :, context_len:].view(kv_heads, num_blocks, block, dim)
    v_own = v[0, :, context_len:].view(kv_heads, num_blocks, block, dim)
    outputs = []
    for chunk in mask.chunks:
        q_chunk = q[:, :, chunk.start : chunk.stop]
        rows, keys = groups * (chunk.stop - chunk.start) * block, chunk.key_stop - chunk.key_start
        k_seen = k_context[:, chunk.key_start : chunk.key_stop]
        v_seen = v_context[:, chunk.key_start : chunk.key_stop]
        scores_context = torch.matmul(q_chunk.reshape(kv_heads, rows, dim), k_seen.transpose(1, 2))
        scores_own = torch.einsum("hgnid,hnjd->hgnij", q_chunk, k_own[:, chunk.start : chunk.stop])
        scores = torch.cat([scores_context.view(*q_chunk.shape[:-1], keys), scores_own], dim=-1)
        probs = scores.masked_fill(chunk.blocked, float("-inf")).float().softmax(dim=-1).to(v.dtype)
        out = torch.matmul(probs[..., :keys].reshape(kv_heads, rows, keys), v_seen).view(q_chunk.shape)
        out = out + torch.einsum("hgnij,hnjd->hgnid", probs[..., keys:], v_own[:, chunk.start : chunk.stop])
        outputs.append(out)
    return torch.cat(outputs, dim=2).reshape(1, heads, num_queries, dim)


def _flex_attention(q, k, v, block_mask, scale):
    """flex_attention over the block mask's padded lengths (zeros past the real queries
    and keys, which see and are seen by nothing), compiled on CUDA, eager elsewhere."""
    queries = q.shape[2]
    q_len, kv_len = block_mask.seq_lengths
    q = F.pad(q, (0, 0, 0, q_len - queries))
    k, v = (F.pad(t, (0, 0, 0, kv_len - t.shape[2])) for t in (k, v))
    if compiles_flex(q.device):
        out = compiled_flex()(q, k, v, block_mask, scale)
    else:
        from torch.nn.attention.flex_attention import flex_attention  # torch >= 2.5 only (pyproject allows 2.4)

        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return out[:, :, :queries]


_COMPILED: CompiledFlex | None = None


def compiled_flex() -> CompiledFlex:
    """The process's one compiled flex_attention (the fused kernel on CUDA)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = CompiledFlex()
    return _COMPILED
