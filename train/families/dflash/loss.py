"""DFlash loss and metrics, computed in chunks through the target's frozen lm_head.

Loss: hard cross-entropy on the sequence's own tokens. Slot k of the block at
anchor a predicts `input_ids[a + k]` (no shift), k = 1 .. B-1; slot 0 holds the
anchor and is not scored. Slot k is weighted `exp(-(k-1)/gamma)` (early slots
matter most: a draft is accepted only up to its first miss), labels with
loss_mask == 0 or past the end weigh 0, and the loss is normalised by the sum of
the valid weights. `dflash_loss` normalises one sequence by its own sum; the
trainer weighs each sequence by that sum (`BlockTargets.weight_sum`) to
normalise over all weighted labels of an optimizer step, as SpecForge does.

Why chunked: 512 anchors x 16 slots x a 248K vocabulary is ~4 GB of bf16 logits
per sequence. `_ChunkedHeadLoss` walks the scored rows a chunk at a time, takes
the loss, its gradient w.r.t. the drafter's hidden states, and the metrics from
the same logits, then drops them; the full [N*B, V] logits never exist, in
forward or backward, and nothing is recomputed.

Position weights (`loss.position_weights`): "decay" is the fixed schedule above;
"dpace" is D-PACE (`dpace_weights`), whose weights follow the drafter's current
confidence in each label and are computed inside the chunk walk. DFlash 2's
selector loss (`train.families.dflash.selector_loss`) rides the same walk: the top-K of
each chunk's logits are kept ([rows, K]) and their gradient reaches the hidden
states through the head's rows, so no second [rows, V] pass exists.

Everything a label, weight or metric is compared against lives in `BlockTargets`,
built from `input_ids` / `loss_mask` (or stored target predictions) only — never
from the context features the drafter reads, which may carry training noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.families.dflash.selector import CandidateSelector
from train.families.dflash.selector_loss import selector_loss
from train.families.dflash.targets import BlockTargets
from train.measures import block_metrics


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [N, B] (arXiv 2605.18810; the authors' code is
    Lucas-TY/D-PACE `specforge/core/dflash.py`, speculators' `dpace_loss_decay`).

    confidence [N, B]: q_k, the drafter's probability of slot k's label, from the
    same logits the CE is taken on (exp(-CE_k)); valid [N, B]: slot is scored.
    With s_k = (1 - alpha) q_k + alpha on valid slots and 1 elsewhere (a no-op in
    the products), P_k = s_1 ... s_k is a smooth probability that the draft is
    accepted through slot k, sum_k P_k a surrogate of the accepted length, and
    w_k = sum_{j >= k, valid} P_j is slot k's share of that surrogate's gradient
    (every prefix through k depends on slot k). Weights are 0 on invalid slots.

    Dynamic: the weights depend on the drafter's output, so they are computed
    under no_grad and used as constants; gradients flow only through the CE
    terms they multiply, never through the weights (as in the paper)."""
    with torch.no_grad():
        confidence = confidence.to(torch.promote_types(confidence.dtype, torch.float32))
        mask = valid.to(confidence.dtype)
        smoothed = torch.where(valid.bool(), (1.0 - alpha) * confidence + alpha, torch.ones_like(mask))
        prefix = torch.cumprod(smoothed, dim=-1)
        suffix = (prefix * mask).flip(-1).cumsum(-1).flip(-1)
        return suffix * mask


@dataclass(frozen=True)
class ScoredRows:
    """What each scored row is scored against, none of it differentiable: its label and
    weight, the target's renormalised top-k for the soft KL (`kl_mix` > 0), and
    D-PACE's `reweight` (a function of the rows' CE [M] -> a factor [M]; None: the
    weights are final)."""

    labels: torch.Tensor  # [M]
    weights: torch.Tensor  # [M], fp32
    topk_ids: torch.Tensor | None = None  # [M, K]
    topk_probs: torch.Tensor | None = None  # [M, K]
    kl_mix: float = 0.0
    reweight: Callable[[torch.Tensor], torch.Tensor] | None = None


def chunk_loss(logprobs: torch.Tensor, rows: slice, scored: ScoredRows, need_grad: bool):
    """One chunk's loss terms from its log-probs [n, V]: each row's CE [n], its soft KL
    [n] (None without `kl_mix`) and, when asked, d loss / d logits with the rows'
    static weights, (softmax - (1-m) onehot(label) - m p_target) w."""
    label = scored.labels[rows, None]
    ce = -logprobs.gather(1, label).squeeze(1)
    kl = None
    if scored.kl_mix > 0:
        assert scored.topk_probs is not None and scored.topk_ids is not None  # scored_rows fills them
        p_target, ids = scored.topk_probs[rows], scored.topk_ids[rows]
        kl = (p_target * (p_target.clamp_min(1e-30).log() - logprobs.gather(1, ids))).sum(1)
    if not need_grad:
        return ce, kl, None
    grad_logits = logprobs.exp()
    grad_logits.scatter_add_(1, label, torch.full_like(label, -(1.0 - scored.kl_mix), dtype=grad_logits.dtype))
    if scored.kl_mix > 0:
        grad_logits.scatter_add_(1, ids, -scored.kl_mix * p_target)
    return ce, kl, grad_logits.mul_(scored.weights[rows, None])  # in place: no second [n, V] buffer


def chunk_ranks(logits: torch.Tensor, label: torch.Tensor, top: int, top_k: int):
    """One chunk's ranking: whether each row's label is its top-1 / top-4 / top-8
    ([n, 3] flags), and its top-`top_k` candidate ids and logits for the selector."""
    best = logits.topk(top, dim=-1)
    found = best.indices[:, :8] == label[:, None]
    hits = torch.stack([found[:, 0], found[:, :4].any(1), found.any(1)], dim=1)
    return hits, best.indices[:, :top_k], best.values[:, :top_k]


class _ChunkedHeadLoss(torch.autograd.Function):
    """Weighted CE (+ optional soft KL) through a frozen head, chunk by chunk.

    For each chunk of scored rows: logits = h W^T in fp32, the loss terms and their
    gradient w.r.t. h (`chunk_loss`), and the ranking (`chunk_ranks`). Only the
    [M, H] gradient is kept for backward.

    `scored.reweight` (D-PACE): weights known only after the walk; each row's loss and
    kept gradient are scaled by its factor at the end, which stays exact because the
    factor is a constant of the gradient. top_k > 0 also returns each row's top-k ids
    and logits [M, k] (differentiable: backward adds sum_c g_c W[c] per row through
    `embedding_bag`, no [M, V] tensor); the row weights used are returned too."""

    @staticmethod
    def forward(ctx, hidden, head_weight, scored: ScoredRows, chunk_rows: int, top_k: int):
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        compute = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for gradcheck
        rows, device = hidden.shape[0], hidden.device
        row_ce = torch.zeros(rows, dtype=compute, device=device)
        ce_sum = hidden.new_zeros((), dtype=compute)  # summed chunk by chunk: the decay loss as it always was
        kl_sum = hidden.new_zeros((), dtype=compute)
        hits = torch.zeros(rows, 3, dtype=torch.bool, device=device)  # top1, top4, top8
        top = min(max(8, top_k), head_weight.shape[0])
        candidates = torch.zeros(rows, top_k, dtype=torch.long, device=device)
        unary = torch.zeros(rows, top_k, dtype=compute, device=device)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, min(start + chunk_rows, rows))
            logits = F.linear(hidden[chunk], head_weight).to(compute)
            row_ce[chunk], kl, grad_logits = chunk_loss(torch.log_softmax(logits, dim=-1), chunk, scored, need_grad)
            ce_sum += (row_ce[chunk] * scored.weights[chunk]).sum()
            if kl is not None:
                kl_sum += (kl * scored.weights[chunk]).sum()
            if grad_hidden is not None and grad_logits is not None:
                grad_hidden[chunk] = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
            hits[chunk], candidates[chunk], unary[chunk] = chunk_ranks(logits, scored.labels[chunk], top, top_k)
        row_weights = scored.weights
        if scored.reweight is not None:
            factor = scored.reweight(row_ce)
            row_weights = row_weights * factor
            ce_sum = (row_ce * row_weights).sum()
            if grad_hidden is not None:
                grad_hidden *= factor[:, None].to(grad_hidden.dtype)
        if need_grad:
            ctx.save_for_backward(grad_hidden, head_weight, candidates)
        ctx.mark_non_differentiable(hits, candidates, row_weights)
        loss = (1.0 - scored.kl_mix) * ce_sum + scored.kl_mix * kl_sum
        return loss, ce_sum.detach(), kl_sum.detach(), hits, candidates, unary, row_weights

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kl, _grad_hits, _grad_candidates, grad_unary, _grad_weights):
        grad_hidden, head_weight, candidates = ctx.saved_tensors
        grad = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if candidates.shape[1] and grad_unary is not None:
            through_head = F.embedding_bag(
                candidates, head_weight, per_sample_weights=grad_unary.to(head_weight.dtype), mode="sum"
            )
            grad = grad + through_head.to(grad.dtype)
        return grad, None, None, None, None


@dataclass
class LossOutput:
    """loss: scalar to backpropagate (with DFlash 2's selector term when a selector
    is given). ce / kl / selector: the terms, detached (0 when off). metrics:
    detached tensors, see `block_metrics`."""

    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    metrics: dict
    selector: torch.Tensor | None = None


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: BlockTargets,
    *,
    chunk_rows: int,
    kl_mix: float = 0.0,
    selector: CandidateSelector | None = None,
    selector_top_k: int = 16,
    selector_weight: float = 1.0,
) -> LossOutput:
    """Loss and metrics of drafter outputs `hidden` [N, B, H] against `targets`.

    lm_head_weight: the target's frozen head [V, H] (TargetHead.lm_head.weight).
    chunk_rows: scored rows per chunk (the run's `loss.chunk_rows`); peak extra
        memory ~ chunk_rows x V fp32.
    kl_mix: weight m of the optional soft KL to the target's top-k distribution,
        loss = (1 - m) CE + m KL (default 0: hard CE only, as DFlash trains).
    Position weights follow `targets.position_weights` ("decay" or "dpace").
    selector (DFlash 2, None for DFlash): a module with `pair_scores`; adds
        `selector_weight` x its K-way CE over the top-`selector_top_k` candidates
        (`train.families.dflash.selector_loss`), with the same row weights as the main
        loss, and the recall@K / selector accuracy metrics.
    Gradients flow to `hidden` (and the selector's parameters); the head stays frozen."""
    if not 0.0 <= kl_mix <= 1.0:
        raise ValueError(f"kl_mix must be in [0, 1], got {kl_mix}")
    if kl_mix > 0 and (targets.topk_ids is None or targets.topk_logprobs is None):
        raise ValueError("kl_mix > 0 needs target top-k ids/logprobs in BlockTargets")
    if kl_mix > 0 and targets.position_weights == "dpace":
        raise ValueError("D-PACE weighs the hard CE only: kl_mix must be 0")
    num_blocks, block_size, hidden_size = hidden.shape
    scored = targets.valid.flatten().nonzero().flatten()  # slot 0 and invalid slots cost nothing
    rows = hidden.reshape(-1, hidden_size)[scored]
    against = scored_rows(targets, scored, kl_mix)
    top_k = int(selector_top_k) if selector is not None else 0
    loss, ce, kl, row_hits, candidates, unary, row_weights = _ChunkedHeadLoss.apply(
        rows, lm_head_weight, against, int(chunk_rows), top_k
    )
    labels = against.labels
    selector_term = None
    flags = {}
    if selector is not None:
        predecessors = targets.predecessors.flatten()[scored]
        picked = selector_loss(selector, rows, unary, candidates, labels, predecessors, row_weights)
        selector_term = picked.loss.detach()
        loss = loss + selector_weight * picked.loss
        flags = {"in_topk": picked.in_topk, "selector_hit": picked.hit}
    per_slot = {
        name: slot_flags(row_flags, scored, (num_blocks, block_size))
        for name, row_flags in {"hits": row_hits, **flags}.items()
    }
    hits, extra = per_slot["hits"], {name: per_slot.get(name) for name in ("in_topk", "selector_hit")}
    metrics = block_metrics(hits[..., 0], hits[..., 1], hits[..., 2], targets.valid, **extra)
    return LossOutput(loss=loss, ce=ce, kl=kl, metrics=metrics, selector=selector_term)


def scored_rows(targets: BlockTargets, scored: torch.Tensor, kl_mix: float) -> ScoredRows:
    """What the rows `scored` of `targets`' [N, B] slots are scored against: labels,
    weights, the renormalised target top-k (kl_mix > 0), D-PACE's reweighting."""
    topk_ids = topk_probs = None
    if kl_mix > 0:
        assert targets.topk_ids is not None and targets.topk_logprobs is not None  # checked by dflash_loss
        topk_ids = targets.topk_ids.flatten(0, 1)[scored]
        probs = targets.topk_logprobs.flatten(0, 1)[scored].exp()
        topk_probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-30)  # renormalised top-k
    reweight = dpace_reweight(targets, scored) if targets.position_weights == "dpace" else None
    return ScoredRows(
        targets.labels.flatten()[scored],
        targets.weights.flatten()[scored].float(),
        topk_ids,
        topk_probs,
        float(kl_mix),
        reweight,
    )


def dpace_reweight(targets: BlockTargets, scored: torch.Tensor):
    """D-PACE's row factors from the rows' CE (confidence exp(-CE) per slot), for
    the scored rows `scored` of `targets`' [N, B] slots."""
    num_blocks, block_size = targets.valid.shape

    def reweight(row_ce: torch.Tensor) -> torch.Tensor:
        confidence = torch.zeros(num_blocks * block_size, dtype=row_ce.dtype, device=row_ce.device)
        confidence[scored] = torch.exp(-row_ce)
        factor = dpace_weights(confidence.view(num_blocks, block_size), targets.valid, targets.dpace_alpha)
        return factor.flatten()[scored]

    return reweight


def slot_flags(row_flags: torch.Tensor, scored: torch.Tensor, blocks: tuple[int, int]) -> torch.Tensor:
    """Flags of the scored rows back in their [N, B, ...] slots (False elsewhere)."""
    full = torch.zeros((blocks[0] * blocks[1],) + row_flags.shape[1:], dtype=torch.bool, device=row_flags.device)
    full[scored] = row_flags
    return full.view(blocks + row_flags.shape[1:])
