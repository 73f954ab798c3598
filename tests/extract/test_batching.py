"""Length batching within a group of shards (`extract.jobs.batching`)."""

from __future__ import annotations

import math
import random

import pytest

from extract.jobs.batching import (
    FORWARD_COST_SHARE,
    batch_groups,
    batches_by_length,
    batches_min_padding,
    padded_tokens,
)


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


def padded_ratio(shards: list[list[int]], budget: int, batch_shards: int, cut=batches_by_length) -> float:
    """Computed / real tokens when each group of `batch_shards` shards is batched as one set."""
    groups = batch_groups([str(i) for i in range(len(shards))], batch_shards)
    padded = 0
    for group in groups:
        lengths = [n for name in group for n in shards[int(name)]]
        padded += padded_tokens(lengths, cut(lengths, budget))
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


def _cost(lengths, batches, budget: int) -> int:
    return padded_tokens(lengths, batches) + len(batches) * max(1, round(FORWARD_COST_SHARE * budget))


def test_min_padding_is_the_best_cut_of_the_sorted_samples():
    """Issue 27.4: against every way of cutting the length-sorted samples into
    batches within the budget (brute force over 2^(n-1) cut sets), the dynamic
    programme finds the least padded tokens + per-forward cost; every index once."""
    import itertools

    rng = random.Random(3)
    for trial in range(40):
        n, budget = rng.randint(1, 10), rng.choice((300, 1000, 4096))
        lengths = [rng.randint(20, 600) for _ in range(n)]
        batches = batches_min_padding(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(n))
        assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget for b in batches)
        order = sorted(range(n), key=lambda i: (-lengths[i], i))
        best = None
        for cuts in itertools.product((False, True), repeat=n - 1):
            parts, start = [], 0
            for position, cut in enumerate(cuts, 1):
                if cut:
                    parts.append(order[start:position])
                    start = position
            parts.append(order[start:])
            if all(len(b) == 1 or len(b) * lengths[b[0]] <= budget for b in parts):
                cost = _cost(lengths, parts, budget)
                best = cost if best is None else min(best, cost)
        assert _cost(lengths, batches, budget) == best, (trial, lengths, budget, batches)


def test_min_padding_is_deterministic_limits_rows_and_runs_the_heaviest_batch_first():
    lengths = [5, 100, 30, 31, 99, 7, 250, 6, 30, 30]
    batches = batches_min_padding(lengths, 200)
    assert batches == batches_min_padding(list(lengths), 200)  # a function of the lengths alone
    assert [6] in batches  # 250 > budget: alone
    heaviest = [len(b) * max(lengths[i] for i in b) for b in batches]
    assert heaviest[0] == max(heaviest)
    assert all(len(b) <= 2 for b in batches_min_padding(lengths, 10_000, max_batch_size=2))
    assert batches_min_padding([], 10) == []
    assert batches_min_padding([7, 7, 7], 100) == [[0, 1, 2]]  # equal lengths: one batch, ties in input order
    with pytest.raises(ValueError):
        batches_min_padding(lengths, 0)


def test_min_padding_reaches_the_goal_where_the_greedy_fill_does_not():
    """Issue 27.4 (padded_token_ratio <= 1.05): on the chat-like mix with groups of 4
    shards the greedy fill pads 8 %, the minimal cut under 3 %, at both budgets; with
    a handful of short samples per shard (the benchmark's shape) the greedy fill
    stays above 1.2 and the minimal cut under 1.05."""
    shards = _shards(_length_mix(6000))
    for budget in (16384, 32768):
        greedy, best = (padded_ratio(shards, budget, 4, cut) for cut in (batches_by_length, batches_min_padding))
        assert best < 1.035 < greedy, (budget, greedy, best)
    rng = random.Random(5)
    small = _shards([int(math.exp(rng.gauss(math.log(220), 0.6))) for _ in range(200)], shard_tokens=3000)
    greedy, best = (padded_ratio(small, 4096, 4, cut) for cut in (batches_by_length, batches_min_padding))
    assert best <= 1.05 < 1.2 < greedy, (greedy, best)
