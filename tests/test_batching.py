"""Length batching within a group of shards (`extract.batching`)."""

from __future__ import annotations

import math
import random

import pytest

from extract.batching import batch_groups, batches_by_length, padded_tokens


def _length_mix(count: int, seed: int = 0) -> list[int]:
    """Chat-like lengths: log-normal around 1,800 tokens, cut at max_length 3072."""
    rng = random.Random(seed)
    return [max(40, min(3072, int(math.exp(rng.gauss(math.log(1800), 0.75))))) for _ in range(count)]


def _shards(lengths: list[int], shard_tokens: int = 32768) -> list[list[int]]:
    shards, current = [], []
    for n in lengths:
        if current and sum(current) + n > shard_tokens:
            shards.append(current)
            current = []
        current.append(n)
    return shards + [current]


def padded_ratio(shards: list[list[int]], budget: int, batch_shards: int) -> float:
    """Computed / real tokens when each group of `batch_shards` shards is batched as one set."""
    groups = batch_groups([str(i) for i in range(len(shards))], batch_shards)
    padded = 0
    for group in groups:
        lengths = [n for name in group for n in shards[int(name)]]
        padded += padded_tokens(lengths, batches_by_length(lengths, budget))
    return padded / sum(map(sum, shards))


def test_groups_are_consecutive_plan_shards():
    names = [f"shard-{i:06d}" for i in range(10)]
    assert batch_groups(names, 4) == [tuple(names[0:4]), tuple(names[4:8]), tuple(names[8:10])]
    assert batch_groups(names, 1) == [(n,) for n in names]
    assert batch_groups(names, 4) == batch_groups(list(reversed(list(reversed(names)))), 4)  # a function of the plan
    with pytest.raises(ValueError):
        batch_groups(names, 0)


def test_batching_a_group_pads_less_than_batching_each_shard():
    """Issue 15.2: on a chat-like length mix (~17 samples per 32K-token shard) the
    padded/real token ratio falls from per-shard batching to groups of 4 and of 8
    shards, at both budgets the README discusses."""
    shards = _shards(_length_mix(6000))
    for budget in (16384, 32768):
        alone, four, eight = (padded_ratio(shards, budget, k) for k in (1, 4, 8))
        assert alone > four > eight >= 1.0, (budget, alone, four, eight)
        assert alone - eight > 0.1 and eight < 1.1, (budget, alone, four, eight)


def test_padded_tokens_counts_each_batch_at_its_longest():
    lengths = [5, 100, 30, 31, 99, 7]
    batches = batches_by_length(lengths, 200)
    assert padded_tokens(lengths, batches) == sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded_tokens(lengths, [[i] for i in range(len(lengths))]) == sum(lengths)  # one per batch: no padding
