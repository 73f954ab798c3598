"""Which samples go through the target together.

A batch is right-padded to its longest sample, so the device computes
``len(batch) * longest`` tokens for ``sum(lengths)`` real ones; the job reports
their ratio as ``padded_token_ratio``. Two things set it.

- The window: ``--batch-shards K`` consecutive shards of the plan go to one worker
  together and their samples are batched by length as one set (one shard alone,
  ~10-22 samples, leaves little choice). The worker holds the whole window's
  captured states until its shards are written: K x shard tokens x context layers x
  hidden x 2 bytes (1 + 4/hidden for fp8), twice over while the next window
  computes (docs/extraction.md).
- Where batches are cut (`batches_min_padding`): over the window's samples sorted
  by length, the cuts that minimise padded tokens plus a fixed cost per forward
  (`FORWARD_COST_SHARE` of the budget), found exactly by dynamic programming. The
  greedy fill (`batches_by_length`: as many samples as the budget takes, longest
  first) pads each batch's tail of shorter samples up to its longest; cutting where
  the lengths step down instead costs a few more, smaller forwards.

On a chat-like length mix (log-normal around 1,800 tokens, cut at 3072; ~17
samples per 32K-token shard) at ``--batch-tokens 16384``: greedy 1.19x per shard,
1.08x with K=4, 1.05x with K=8; minimal padding 1.02x with K=4 and 1.016x with K=8
(`tests/extract/test_batching.py`; the job reports the ratio it ran at).

Groups are fixed by the plan and K, never by timing: a sample meets the same batch
in every run, so a rerun or a resumed job writes byte-identical shards (a group
whose shards are partly committed is recomputed whole; only the missing shards are
written). Packing samples into one row with per-sample attention boundaries would
pad nothing, but the hybrid targets' linear-attention layers (gated delta rule,
causal conv1d) would need per-sample state resets that their PyTorch fallback lacks.
"""

from __future__ import annotations

from collections.abc import Sequence

# What one more forward is taken to cost, as a share of the batch budget in padded
# tokens: a cut that saves less padding than this is not made. Small, because a
# forward's fixed cost (launch, host sync) is small beside a budget's tokens; not
# zero, which would cut every sample into a batch of its own.
FORWARD_COST_SHARE = 0.02


def batches_by_length(
    lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int | None = None
) -> list[list[int]]:
    """Group sample indices so that each batch's *padded* size
    (``len(batch) * max length in batch``) stays within ``max_batch_tokens``.

    Samples are taken longest first (so the heaviest batch runs first and an
    out-of-memory shows up at once) and packed greedily, which puts samples of
    similar length together. A sample longer than the budget gets a batch of its
    own. Deterministic: ties keep input order. Every index appears exactly once.
    """
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = int(lengths[current[0]]) if current else int(lengths[index])
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or (len(current) + 1) * longest > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def batches_min_padding(
    lengths: Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int | None = None,
    forward_cost_share: float = FORWARD_COST_SHARE,
) -> list[list[int]]:
    """Group sample indices into batches of *padded* size (``len(batch) * longest``)
    within ``max_batch_tokens`` (a longer sample alone), minimising padded tokens +
    ``forward_cost_share * max_batch_tokens`` per batch over the samples sorted by
    length (exact: dynamic programming over the cut points, integer costs).

    Deterministic (ties keep input order), every index exactly once; the batch with
    the most padded tokens runs first, so an out-of-memory shows up at once."""
    _check_limits(max_batch_tokens, max_batch_size)
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    sizes = [int(lengths[i]) for i in order]
    per_forward = max(1, round(forward_cost_share * max_batch_tokens))
    rows_limit = max_batch_size or len(sizes)
    # best[j]: least cost of batching the j longest samples; cut[j]: where its last batch starts
    best, cut = [0] + [None] * len(sizes), [0] * (len(sizes) + 1)
    for end in range(1, len(sizes) + 1):
        for start in range(end - 1, max(-1, end - 1 - rows_limit), -1):
            padded = (end - start) * sizes[start]  # sizes descend: the batch's first is its longest
            if padded > max_batch_tokens and end - start > 1:
                break  # longer batches only grow
            previous = best[start]
            assert previous is not None  # every shorter prefix has a batching by now
            cost = previous + padded + per_forward
            current = best[end]
            if current is None or cost < current:
                best[end], cut[end] = cost, start
    batches, end = [], len(sizes)
    while end:
        batches.append(order[cut[end] : end])
        end = cut[end]
    batches.reverse()
    return sorted(batches, key=lambda batch: -len(batch) * int(lengths[batch[0]]))


def _check_limits(max_batch_tokens: int, max_batch_size: int | None) -> None:
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens the device computes for these batches (each padded to its longest)."""
    return sum(len(batch) * max(int(lengths[i]) for i in batch) for batch in batches if batch)


def batch_groups(shard_names: Sequence[str], batch_shards: int) -> list[tuple[str, ...]]:
    """The plan's shards (in plan order) cut into groups of `batch_shards` consecutive ones."""
    if batch_shards < 1:
        raise ValueError(f"batch_shards must be >= 1, got {batch_shards}")
    names = list(shard_names)
    return [tuple(names[i : i + batch_shards]) for i in range(0, len(names), batch_shards)]
