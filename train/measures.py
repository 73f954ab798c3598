"""Acceptance metrics of a DFlash drafter: greedy-chain and DDTree acceptance per
block, the decode-time rollout that turns them into tau, and per-position / top-k
accuracy. Pure functions on tensors, no model code.

Conventions (all inputs cover the drafted slots 1..B-1 of each block, so the
last dimension is D = B-1; slot 0, the anchor, is never drafted):

- `reference` [N, D]: the continuation the target would verify against: the
  stored tokens `input_ids[a + k]`, or the target's own greedy predictions.
- `valid` [N, D]: slot k can be verified (inside the sequence and part of the
  response, loss_mask == 1). A draft can never be accepted through an invalid
  slot, so a streak stops at the first invalid slot.
- A block is *scored* when its slot 1 is valid (`scored_blocks`). A block whose
  very first drafted position is not part of the response (the anchor is the
  response's last token) would not be drafted at serving time.

Acceptance length of one verification round, as z-lab's benchmark counts it
(`dflash/benchmark.py`: `acceptance_length + 1` per round) and DDTree's
(`len(accepted_indices)`, root included): the number of accepted draft tokens
plus the one bonus token the target emits itself, so 1..B. tau is its mean over
the rounds of a sample, then over samples (z-lab averages per response first).

Two averages of it, and why they differ. *Per position* (`tau_per_position`):
the mean over blocks anchored at every response position. *Decode-time*
(`rollout`, reported as `tau`): decoding does not visit every position. It
starts at the first response position (the token the target's prefill emits),
accepts the matching draft prefix, and moves the anchor by accepted + 1, so a
stretch the drafter finds easy is crossed in a few long rounds and a hard one
in many rounds of length 1; averaging over rounds weighs the hard stretches
by the rounds they cost. On a text with easy and hard stretches the per-position
mean is the larger one (5.60 against a rollout's 3.19 on the reference that
prompted this), and only the rollout is what a server measures.

DDTree (Ringel & Romano, arXiv 2604.12989; reference code liranringel/ddtree
`build_ddtree_tree`): from the drafter's per-slot log-probabilities, grow a tree
best-first. A node is a path (r_1 .. r_d) of ranks into the per-slot top-k lists,
scored by the sum of its log-probs. The heap starts with the path (0,) (slot 1's
top token). Pop the best path and add it as a node; push its next sibling
(r_1 .. r_d + 1) and its first child (r_1 .. r_d, 0); stop when the tree holds
`budget` nodes (the root, i.e. the anchor/bonus token, is not counted). Ties are
broken by the rank tuple, as in the reference code. Verification walks the tree
from the root along the reference continuation; the accepted length is the
depth reached (+1 bonus).

Because a path scores no higher than its parent (log-probs <= 0) and no higher
than its previous sibling (top-k lists are sorted), the pop order is a
non-increasing score order and the tree of budget b is exactly the first b pops.
`ddtree_acceptance` therefore grows the tree once at the largest budget, records
the pop index of each node on the reference path, and reads every budget off it:
the accepted depth at budget b is the longest reference prefix whose nodes were
all popped before b. Monotone in b by construction.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Iterable, Iterator, Sequence

import torch


def _check_slots(reference: torch.Tensor, valid: torch.Tensor, *others: torch.Tensor) -> None:
    if reference.dim() != 2:
        raise ValueError(f"reference must be [N, B-1], got shape {tuple(reference.shape)}")
    if valid.shape != reference.shape:
        raise ValueError(f"valid {tuple(valid.shape)} and reference {tuple(reference.shape)} differ in shape")
    for other in others:
        if other.shape[:2] != reference.shape:
            raise ValueError(f"drafter output {tuple(other.shape)} does not match reference {tuple(reference.shape)}")


def scored_blocks(valid: torch.Tensor) -> torch.Tensor:
    """[N] bool: blocks whose slot 1 can be verified (the only ones a server drafts)."""
    if valid.shape[1] == 0:
        return torch.zeros(valid.shape[0], dtype=torch.bool, device=valid.device)
    return valid[:, 0].bool()


def chain_accepted(pred_top1: torch.Tensor, reference: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] int64: draft tokens accepted by greedy chain verification, 0..B-1.

    The drafter's top-1 token at slot k is accepted when it equals the reference
    at slot k, the slot is valid, and every earlier slot was accepted."""
    _check_slots(reference, valid, pred_top1)
    correct = (pred_top1 == reference) & valid.bool()
    return correct.long().cumprod(dim=1).sum(dim=1)


def chain_acceptance(pred_top1: torch.Tensor, reference: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] int64 acceptance length per block under greedy chain verification:
    accepted prefix + 1 bonus token, in 1..B. Use `scored_blocks(valid)` to pick
    the blocks that count, and `tau` to average."""
    return chain_accepted(pred_top1, reference, valid) + 1


def rollout(anchors: Sequence[int], accepted_at: Callable[[int], int]) -> list[int]:
    """Acceptance lengths (accepted + 1 bonus) of the verification rounds of
    decoding along a reference text, in order.

    anchors: sorted positions a round may anchor at (a response position whose
    next position is one too); a run of consecutive anchors is one stretch of a
    response. accepted_at(a): draft tokens the block anchored at `a` gets
    accepted (0..B-1), called only for the anchors the rollout visits, so an
    expensive verification (a DDTree) is paid for those alone.
    Each stretch starts at its first position; a round at anchor a accepts
    accepted_at(a) tokens plus the bonus and hands the next round the anchor
    a + accepted_at(a) + 1; the stretch ends when the anchor leaves it."""
    positions = set(anchors)
    lengths = []
    for start in anchors:
        if start - 1 in positions:
            continue  # not the first position of its stretch
        anchor = start
        while anchor in positions:
            accepted = int(accepted_at(anchor))
            lengths.append(accepted + 1)
            anchor += accepted + 1
    return lengths


def best_first_tree(lp: list[list[float]]) -> Iterator[tuple[int, ...]]:
    """DDTree's nodes in pop order (the module docstring's rule), each the path of ranks
    (r_1 .. r_d) into the per-slot sorted lists `lp` [D][K] of log-probs; the caller
    stops after its budget. The one owner of the tree rule: `eval` reads its reference
    path off it and `speculate --tree` builds the tree it verifies from it."""
    depth_limit, k = len(lp), len(lp[0])
    heap: list[tuple[float, tuple[int, ...]]] = [
        (-lp[0][0], (0,))
    ]  # ties broken by the rank tuple, as the reference code does
    while heap:
        negative, ranks = heapq.heappop(heap)
        yield ranks
        score, depth, rank = -negative, len(ranks), ranks[-1]
        if rank + 1 < k:
            heapq.heappush(heap, (-(score - lp[depth - 1][rank] + lp[depth - 1][rank + 1]), ranks[:-1] + (rank + 1,)))
        if depth < depth_limit:
            heapq.heappush(heap, (-(score + lp[depth][0]), ranks + (0,)))


def _reference_pop_indices(lp: list[list[float]], ref_ranks: list[int], budget: int) -> list[int]:
    """Pop index (0-based) of each node on the reference path, in depth order, in a
    tree of `budget` nodes (`best_first_tree`).

    lp: [D][K] sorted log-probs; ref_ranks: rank of the reference token at slots
    1..d, cut before the first slot whose token is outside the top-K or invalid.
    Stops as soon as the whole usable reference path has been popped."""
    found: list[int] = []
    if budget <= 0 or not ref_ranks:
        return found
    path = tuple(ref_ranks)
    for index, ranks in enumerate(best_first_tree(lp)):
        if index >= budget:
            break
        if ranks == path[: len(ranks)]:
            found.append(index)
            if len(ranks) == len(path):
                break  # every usable reference node is in the tree
    return found


def ddtree_acceptance(
    slot_logprobs: torch.Tensor,
    slot_ids: torch.Tensor,
    reference: torch.Tensor,
    valid: torch.Tensor,
    budget: int | Iterable[int],
) -> torch.Tensor | dict[int, torch.Tensor]:
    """Acceptance length per block (accepted + 1 bonus, 1..B) under DDTree
    verification with a node budget.

    slot_logprobs [N, D, K] / slot_ids [N, D, K]: the drafter's top-K per slot,
    log_softmax over the full vocabulary, sorted descending. K >= budget is
    exact (a tree of b nodes never uses a rank >= b); a smaller K caps the tree
    at what the lists hold, as the reference code's `topk = min(budget, V)` does.
    reference [N, D], valid [N, D]: as for `chain_acceptance`.
    budget: one int -> [N] tensor; several -> {budget: [N] tensor}, all read off
    one tree growth at the largest budget."""
    _check_slots(reference, valid, slot_logprobs, slot_ids)
    budgets = [int(budget)] if isinstance(budget, int) else [int(b) for b in budget]
    if slot_logprobs.shape != slot_ids.shape:
        raise ValueError(
            f"slot_logprobs {tuple(slot_logprobs.shape)} and slot_ids {tuple(slot_ids.shape)} differ in shape"
        )
    num_blocks, depth_limit, _k = slot_ids.shape
    largest = max(budgets) if budgets else 0
    # Rank of each reference token in its slot's top-K list (-1: absent or invalid slot).
    match = slot_ids == reference[..., None]
    ranks = torch.where(match.any(-1), match.float().argmax(-1), torch.full_like(reference, -1))
    ranks = torch.where(valid.bool(), ranks, torch.full_like(ranks, -1))
    all_lp = slot_logprobs.float().tolist()
    all_ranks = ranks.tolist()
    pops = []
    for n in range(num_blocks):
        ref_ranks = all_ranks[n]
        usable = 0  # cut the path at its first unusable slot: nothing deeper can be accepted
        while usable < depth_limit and ref_ranks[usable] >= 0:
            usable += 1
        pops.append(_reference_pop_indices(all_lp[n], ref_ranks[:usable], largest))
    out = {}
    for b in budgets:
        accepted = [sum(1 for _ in _prefix_below(p, b)) for p in pops]
        out[b] = torch.tensor(accepted, dtype=torch.long) + 1
    return out[budgets[0]] if isinstance(budget, int) else out


def _prefix_below(pop_indices: list[int], budget: int):
    """The reference-path nodes that made it into a tree of `budget` nodes. Pop
    indices increase along a path, so this is a prefix."""
    for index in pop_indices:
        if index >= budget:
            return
        yield index


def topk_hits(
    slot_ids: torch.Tensor, reference: torch.Tensor, ks: Sequence[int] = (1, 4, 8)
) -> dict[int, torch.Tensor]:
    """{k: [N, D] bool}: the reference token is among the drafter's top k
    (slot_ids [N, D, K] sorted by score; needs K >= max(ks))."""
    if slot_ids.shape[-1] < max(ks):
        raise ValueError(f"top-{max(ks)} hits need at least {max(ks)} ids per slot, got {slot_ids.shape[-1]}")
    match = slot_ids == reference[..., None]
    return {k: match[..., :k].any(-1) for k in ks}


def accuracy_counts(hits: dict[int, torch.Tensor], valid: torch.Tensor) -> dict:
    """Counts to pool accuracy over many blocks/samples: per-position hits and
    valid slots [D] (for slot 1..D top-1 accuracy), and totals per k."""
    valid = valid.bool()
    counts = {"valid": int(valid.sum()), "per_position_valid": valid.sum(0).long()}
    for k, hit in hits.items():
        hit = hit & valid
        counts[f"top{k}"] = int(hit.sum())
        if k == 1:
            counts["per_position_top1"] = hit.sum(0).long()
    return counts


def block_metrics(
    top1: torch.Tensor,
    top4: torch.Tensor,
    top8: torch.Tensor,
    valid: torch.Tensor,
    in_topk: torch.Tensor | None = None,
    selector_hit: torch.Tensor | None = None,
) -> dict:
    """Metrics from per-slot hit flags [N, B] and validity [N, B].

    top1/top4/top8: fraction of valid slots whose label is in the drafter's top k.
    per_position_acc: [B-1] top-1 accuracy of slots 1..B-1 (nan where no valid slot).
    tau: expected acceptance length under greedy chain verification, the mean over
        blocks with any valid slot of (correct streak from slot 1 + 1); a streak
        stops at the first wrong or invalid slot.
    num_valid / num_blocks: denominators, for averaging across steps.
    DFlash 2 (when the flags are given): recall_at_k, the fraction of valid slots
    whose label is among the selector's K candidates (`in_topk`), and
    selector_acc, the fraction where the teacher-forced selector's argmax is the
    label (`selector_hit`); both over valid slots, like top1."""
    valid = valid.bool()
    count = valid.sum()
    denominator = count.clamp_min(1).float()
    correct = top1 & valid
    per_slot_valid = valid[:, 1:].sum(0).float()
    per_position = torch.where(
        per_slot_valid > 0,
        correct[:, 1:].sum(0).float() / per_slot_valid.clamp_min(1),
        torch.full_like(per_slot_valid, math.nan),
    )
    streak = correct[:, 1:].long().cumprod(dim=1).sum(1)
    scored_blocks = valid.any(1)
    num_blocks = scored_blocks.sum()
    tau = ((streak + 1).float() * scored_blocks).sum() / num_blocks.clamp_min(1).float()
    metrics = {
        "top1": (correct.sum() / denominator).detach(),
        "top4": ((top4 & valid).sum() / denominator).detach(),
        "top8": ((top8 & valid).sum() / denominator).detach(),
        "per_position_acc": per_position.detach(),
        "tau": tau.detach(),
        "num_valid": count.detach(),
        "num_blocks": num_blocks.detach(),
    }
    if in_topk is not None:
        metrics["recall_at_k"] = ((in_topk & valid).sum() / denominator).detach()
    if selector_hit is not None:
        metrics["selector_acc"] = ((selector_hit & valid).sum() / denominator).detach()
    return metrics
