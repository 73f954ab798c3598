"""Chain and DDTree acceptance on hand-built drafter outputs whose answers are
worked out by hand, and properties over random drafter outputs; the fast DDTree
path against a plain tree built and walked here; the decode-time rollout against
the per-position estimate on texts with hard stretches, both counted by hand.
(tau's per-sample-then-over-samples average is checked through
`train.evaluation.evaluate` in test_eval.py.)"""

from __future__ import annotations

import heapq
from typing import Sequence

import pytest
import torch

from train.evaluation.evaluate import per_position_rows, rollout_anchors
from train.families.dflash.anchors import anchor_candidates
from train.families.dflash.config import LossConfig
from train.families.dflash.targets import block_targets
from train.families.family import DraftedBlocks
from train.measures import (
    accuracy_counts,
    chain_acceptance,
    chain_accepted,
    ddtree_acceptance,
    rollout,
    scored_blocks,
    topk_hits,
)

V = 10
B = 5  # anchor + 4 drafted slots


def build_ddtree(slot_logprobs: torch.Tensor, slot_ids: torch.Tensor, budget: int) -> list[tuple[int, int, int]]:
    """The DDTree of one block as a list of nodes in pop order.

    slot_logprobs / slot_ids: [D, K], the drafter's top-K log-probs (log_softmax
    over the full vocabulary, sorted descending) and token ids per drafted slot.
    Returns [(parent, depth, token)] for nodes 1..n, where parent 0 is the root
    (the anchor) and node i is the i-th entry (1-based). n = min(budget, nodes
    that exist). The plain tree, as train/measures.py's docstring defines it:
    the oracle `ddtree_acceptance` (the fast path) is checked against."""
    nodes: list[tuple[int, int, int]] = []
    depth_limit, k = slot_logprobs.shape
    if budget <= 0 or depth_limit == 0 or k == 0:
        return nodes
    logp = slot_logprobs.tolist()
    ids = slot_ids.tolist()
    # heap entry: (-score, ranks, parent node index, depth, rank, score)
    heap = [(-logp[0][0], (0,), 0, 1, 0, logp[0][0])]
    while heap and len(nodes) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        nodes.append((parent, depth, ids[depth - 1][rank]))
        index = len(nodes)
        if rank + 1 < k:
            sibling = score - logp[depth - 1][rank] + logp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = score + logp[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), index, depth + 1, 0, child))
    return nodes


def walk_tree(nodes: list[tuple[int, int, int]], reference: Sequence[int], valid: Sequence[bool]) -> int:
    """Accepted draft tokens when verifying the tree `nodes` (from `build_ddtree`)
    against `reference` [D]: the depth of the longest reference prefix that is a
    path from the root, stopping at the first invalid slot."""
    children: dict[tuple[int, int], int] = {}
    for index, (parent, _depth, token) in enumerate(nodes, start=1):
        children[(parent, token)] = index
    node, accepted = 0, 0
    for token, ok in zip(reference, valid):
        if not ok or (node, int(token)) not in children:
            break
        node = children[(node, int(token))]
        accepted += 1
    return accepted


def slot_distribution(order: list[int], probs: list[float]) -> torch.Tensor:
    """Log-probs over V tokens: `order[i]` gets probs[i], the rest share what is left."""
    p = torch.full((V,), (1.0 - sum(probs)) / (V - len(probs)))
    for token, prob in zip(order, probs):
        p[token] = prob
    return p.log()


def drafter_topk(slots: list[torch.Tensor], k: int = V):
    """[1, D, k] sorted top-k log-probs and ids of one block."""
    logprobs = torch.stack(slots)[None]
    values, ids = logprobs.topk(k, dim=-1)
    return values, ids


# Slot 1: token 1 at 0.9; slot 2: token 2 at 0.6, token 7 at 0.3; slots 3, 4: tokens 3, 4 at 0.9.
SLOTS = [
    slot_distribution([1, 6], [0.9, 0.05]),
    slot_distribution([2, 7], [0.6, 0.3]),
    slot_distribution([3, 8], [0.9, 0.05]),
    slot_distribution([4, 9], [0.9, 0.05]),
]
ALL_VALID = torch.ones(1, B - 1, dtype=torch.bool)


def test_perfect_drafter_gives_tau_B():
    values, ids = drafter_topk(SLOTS)
    reference = torch.tensor([[1, 2, 3, 4]])
    lengths = chain_acceptance(ids[..., 0], reference, ALL_VALID)
    assert lengths.tolist() == [B]
    assert ddtree_acceptance(values, ids, reference, ALL_VALID, 4).tolist() == [B]  # the chain is the best 4 nodes


def test_wrong_at_slot_1_gives_tau_1_whatever_follows():
    values, ids = drafter_topk(SLOTS)
    reference = torch.tensor([[5, 2, 3, 4]])  # slot 1 is token 5 (prob 0.00625), the rest as drafted
    assert chain_acceptance(ids[..., 0], reference, ALL_VALID).tolist() == [1]
    assert ddtree_acceptance(values, ids, reference, ALL_VALID, 8).tolist() == [1]


def test_second_choice_at_slot_2_is_accepted_by_ddtree_once_the_budget_reaches_it():
    """By hand: pops in order of cumulative log-prob
    1: (1)          log .9              = -0.105
    2: (1,2)        + log .6            = -0.616
    3: (1,2,3)      + log .9            = -0.722
    4: (1,2,3,4)    + log .9            = -0.827
    5: (1,7)        log .9 + log .3     = -1.309   <- the reference's slot 2
    6: (1,7,3)                          = -1.415
    7: (1,7,3,4)                        = -1.520
    8: (6)          log .05             = -2.996
    So with reference 1,7,3,4 the chain accepts 1 token (tau 2), DDTree accepts
    1 token up to budget 4, then 2, 3, 4 tokens at budgets 5, 6, 7."""
    values, ids = drafter_topk(SLOTS)
    reference = torch.tensor([[1, 7, 3, 4]])
    assert chain_acceptance(ids[..., 0], reference, ALL_VALID).tolist() == [2]
    by_budget = ddtree_acceptance(values, ids, reference, ALL_VALID, range(1, 9))
    assert [int(by_budget[b]) for b in range(1, 9)] == [2, 2, 2, 2, 3, 4, 5, 5]
    nodes = build_ddtree(values[0], ids[0], 8)
    assert nodes == [(0, 1, 1), (1, 2, 2), (2, 3, 3), (3, 4, 4), (1, 2, 7), (5, 3, 3), (6, 4, 4), (0, 1, 6)]
    assert walk_tree(nodes[:4], [1, 7, 3, 4], [True] * 4) == 1
    assert walk_tree(nodes[:7], [1, 7, 3, 4], [True] * 4) == 4


def test_invalid_slot_ends_the_streak():
    values, ids = drafter_topk(SLOTS)
    reference = torch.tensor([[1, 2, 3, 4]])
    valid = torch.tensor([[True, True, False, True]])
    assert chain_acceptance(ids[..., 0], reference, valid).tolist() == [3]
    assert ddtree_acceptance(values, ids, reference, valid, 32).tolist() == [3]
    assert scored_blocks(torch.tensor([[False, True, True, True], [True, False, False, False]])).tolist() == [
        False,
        True,
    ]


def test_accuracy_helpers_by_hand():
    values, ids = drafter_topk(SLOTS)
    reference = torch.tensor([[1, 7, 8, 0]])  # slot 1 top-1, slot 2 2nd, slot 3 2nd, slot 4 token 0 (rank >= 3)
    hits = topk_hits(ids, reference, (1, 4, 8))
    assert hits[1].tolist() == [[True, False, False, False]]
    assert hits[4].tolist() == [[True, True, True, False]]
    counts = accuracy_counts(hits, torch.tensor([[True, True, True, False]]))
    assert (counts["valid"], counts["top1"], counts["top4"]) == (3, 1, 3)
    assert counts["per_position_top1"].tolist() == [1, 0, 0, 0]
    assert counts["per_position_valid"].tolist() == [1, 1, 1, 0]


def random_drafter(seed: int, blocks: int = 64, slots: int = 7, vocab: int = 12, k: int = 12):
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(blocks, slots, vocab, generator=g) * 2.5, dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    # References: often the drafter's first or second choice, sometimes anything.
    pick = torch.randint(0, 3, (blocks, slots), generator=g)
    reference = torch.where(
        pick == 0,
        ids[..., 0],
        torch.where(pick == 1, ids[..., 1], torch.randint(0, vocab, (blocks, slots), generator=g)),
    )
    valid = torch.rand(blocks, slots, generator=g) < 0.93
    return values, ids, reference, valid


@pytest.mark.parametrize("seed", range(6))
def test_ddtree_is_monotone_in_budget_and_matches_the_plain_tree(seed):
    values, ids, reference, valid = random_drafter(seed)
    budgets = [1, 2, 3, 5, 8, 13, 21, 34, 64]
    result = ddtree_acceptance(values, ids, reference, valid, budgets)
    stacked = torch.stack([result[b] for b in budgets])
    assert (stacked[1:] >= stacked[:-1]).all()
    assert stacked.min() >= 1 and stacked.max() <= reference.shape[1] + 1
    # The fast path equals building the whole tree and walking it.
    for b in (3, 21):
        plain = [
            walk_tree(build_ddtree(values[n], ids[n], b), reference[n].tolist(), valid[n].tolist()) + 1
            for n in range(values.shape[0])
        ]
        assert result[b].tolist() == plain
    # A tree never holds more than `budget` nodes, nor a repeated path.
    nodes = build_ddtree(values[0], ids[0], 34)
    assert len(nodes) == 34 and len({(p, t) for p, _, t in nodes}) == 34


@pytest.mark.parametrize("seed", range(3))
def test_ddtree_with_one_candidate_per_slot_is_the_chain(seed):
    values, ids, reference, valid = random_drafter(seed)
    chain = chain_acceptance(ids[..., 0], reference, valid)
    tree = ddtree_acceptance(values[..., :1], ids[..., :1], reference, valid, reference.shape[1])
    assert tree.tolist() == chain.tolist()
    # And with the full lists, a budget of 1 accepts exactly when slot 1's top-1 is right.
    one = ddtree_acceptance(values, ids, reference, valid, 1)
    assert one.tolist() == (1 + ((ids[:, 0, 0] == reference[:, 0]) & valid[:, 0]).long()).tolist()


# -- decode-time rollout against the per-position estimate -------------------------------
def hard_token_drafter(length: int, hard: set[int]):
    """A text whose token at position p is p (position 0 the prompt, 1.. the
    response) and a drafter that predicts every token right except the ones at
    `hard` positions, drafted at every rollout anchor: DraftedBlocks whose top-1
    is that guess (log-prob -0.01) with 7 alternatives that are never right
    (-10 each, so a DDTree of b <= B-1 nodes is the top-1 chain of depth b)."""
    ids = torch.arange(length)
    mask = torch.ones(length, dtype=torch.uint8)
    mask[0] = 0
    anchors = rollout_anchors(mask)
    targets = block_targets(ids, mask, anchors, B, LossConfig(gamma=1.0, position_weights="decay"))
    reference, valid = targets.labels[:, 1:], targets.valid[:, 1:]
    token_positions = anchors[:, None] + torch.arange(1, B)
    top1 = torch.where(torch.isin(token_positions, torch.tensor(sorted(hard))), -1, reference)
    shape = tuple(reference.shape)
    slot_ids = torch.cat([top1[..., None], (-2 - torch.arange(7)).expand(*shape, 7)], dim=-1)
    logprobs = torch.cat([torch.full((*shape, 1), -0.01), torch.full((*shape, 7), -10.0)], dim=-1)
    accepted = chain_accepted(top1, reference, valid)
    blocks = DraftedBlocks(anchors, reference, valid, logprobs, slot_ids, accepted, unary_accepted=accepted)
    return blocks, mask


def mean(values) -> float:
    return sum(values) / len(values)


def test_rollout_of_a_drafter_that_fails_every_third_block():
    """B = 5 (4 drafted slots), response = positions 1..34, hard tokens 12, 23, 34.
    Decoding: anchor 1 accepts 2..5 (5), anchor 6 accepts 7..10 (5), anchor 11
    misses 12 (1), anchor 12 accepts 13..16 (5), 17 -> 5, 22 misses 23 (1), 23 -> 5,
    28 -> 5, 33 misses 34 (1); anchor 34 is the last token: done. tau = 33/9 = 11/3.
    Per position, at the training anchors 1..30 (a whole block inside the text),
    a block accepts min(4, next hard - a - 1): over 1..11 that is 4 x 7, 3, 2, 1, 0
    (lengths 45), the same over 12..22 (45), then 4 x 7 over 23..29 and 3 at 30
    (39): 129 / 30 = 4.3."""
    blocks, mask = hard_token_drafter(35, {12, 23, 34})
    rounds = blocks.chain_rounds()
    assert rounds == [5, 5, 1] * 3
    assert mean(rounds) == pytest.approx(11 / 3)
    rows = per_position_rows(blocks, anchor_candidates(mask, B), stride=1)
    assert blocks.positions[rows].tolist() == list(range(1, 31))
    assert mean((blocks.accepted[rows] + 1).tolist()) == pytest.approx(4.3)
    # DDTree with 2 nodes (here the top-1 chain of depth 2): rounds of 3 until a
    # hard token falls in the first two slots. Anchor 10 accepts 11 and misses 12
    # (2), anchors 12, 15, 18 accept two each, 21 accepts 22 (2), and so on:
    # [3, 3, 3, 2] x 3 = 33 / 12 = 2.75. With 4 nodes it is the chain again.
    trees = blocks.ddtree_rounds([2, 4])
    assert trees[2] == [3, 3, 3, 2] * 3 and mean(trees[2]) == pytest.approx(2.75)
    assert trees[4] == rounds


def test_rollout_of_a_drafter_perfect_but_for_one_hard_stretch():
    """B = 5, response = positions 1..50, tokens 21..30 hard. Decoding: anchors
    1, 6, 11, 16 accept whole blocks (5 each), then anchors 21..29 each miss the
    next token (9 rounds of 1), anchor 30 resumes: 30, 35, 40, 45 -> 5 each, and
    anchor 50 is the last token. 49 / 17 rounds = 2.882: the hard stretch costs
    9 of 17 rounds. Per position (anchors 1..46): 16 x 5, then 4, 3, 2, 1 at
    17..20, 9 x 1 at 21..29, 17 x 5 at 30..46: 184 / 46 = 4.0."""
    blocks, mask = hard_token_drafter(51, set(range(21, 31)))
    rounds = blocks.chain_rounds()
    assert rounds == [5] * 4 + [1] * 9 + [5] * 4
    assert mean(rounds) == pytest.approx(49 / 17)
    rows = per_position_rows(blocks, anchor_candidates(mask, B), stride=1)
    assert len(rows) == 46 and mean((blocks.accepted[rows] + 1).tolist()) == pytest.approx(4.0)


def test_rollout_walks_each_stretch_from_its_start_and_reads_only_visited_anchors():
    anchors = [3, 4, 5, 6, 7, 20, 21, 22]  # two responses: 3..8 and 20..23
    accepted = {3: 2, 6: 1, 7: 0, 20: 0, 21: 3}
    visited = []

    def at(position):
        visited.append(position)
        return accepted.get(position, 0)

    assert rollout(anchors, at) == [3, 2, 1, 4]
    assert visited == [3, 6, 20, 21]
