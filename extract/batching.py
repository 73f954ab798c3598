"""Which samples go through the target together.

A batch is right-padded to its longest sample, so the device computes
``len(batch) * longest`` tokens for ``sum(lengths)`` real ones; the job reports
their ratio as ``padded_token_ratio``. Batching within one shard (~10-22 samples)
leaves little choice: on a chat-like length mix (log-normal around 1,800 tokens, cut
at 3072; ~17 samples per 32K-token shard) that is 1.19x at ``--batch-tokens 16384``
and 1.28x at 32768. So shards are batched in *groups*: ``--batch-shards K``
consecutive shards of the plan go to one worker together and their samples are
batched by length as one set: 1.08x / 1.14x with K=4, 1.05x / 1.09x with K=8
(`tests/test_batching.py`; the job reports the ratio it ran at).

Groups are fixed by the plan and K, never by timing: a sample meets the same batch
in every run, so a rerun or a resumed job writes byte-identical shards (a group
whose shards are partly committed is recomputed whole; only the missing shards are
written). Packing samples into one row with per-sample attention boundaries would
pad nothing, but the hybrid targets' linear-attention layers (gated delta rule,
causal conv1d) would need per-sample state resets that their PyTorch fallback lacks.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens the device computes for these batches (each padded to its longest)."""
    return sum(len(batch) * max(int(lengths[i]) for i in batch) for batch in batches if batch)


def batch_groups(shard_names: Sequence[str], batch_shards: int) -> list[tuple[str, ...]]:
    """The plan's shards (in plan order) cut into groups of `batch_shards` consecutive ones."""
    if batch_shards < 1:
        raise ValueError(f"batch_shards must be >= 1, got {batch_shards}")
    names = list(shard_names)
    return [tuple(names[i : i + batch_shards]) for i in range(0, len(names), batch_shards)]
