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

Everything a label, weight or metric is compared against lives in `BlockTargets`,
built from `input_ids` / `loss_mask` (or stored target predictions) only — never
from the context features the drafter reads, which may carry training noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The paper's weight decay per block size.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(f"no default gamma for block_size {block_size} (known: {sorted(DEFAULT_GAMMA)}); pass gamma=")
    return DEFAULT_GAMMA[block_size]


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Unnormalised weight per slot, [B]: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


@dataclass
class BlockTargets:
    """What the drafter's blocks are scored against. [N, B] each; slot 0 never valid.

    labels: token each slot must predict.
    valid: slot is scored (inside the sequence, loss_mask == 1, k >= 1).
    weights: exp(-(k-1)/gamma) on valid slots, normalised to sum 1 (all 0 if none).
    topk_ids / topk_logprobs: [N, B, K] target distribution per slot, for the
        optional soft-KL term; None when not given.
    weight_sum: the weights' sum before normalising (a 0-dim tensor): what the
        sequence weighs in a loss normalised over a whole optimizer step."""

    labels: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    weight_sum: torch.Tensor | None = None


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_size: int,
    gamma: float | None = None,
    labels: str = "tokens",
    target_next_ids: torch.Tensor | None = None,
    target_topk_ids: torch.Tensor | None = None,
    target_topk_logprobs: torch.Tensor | None = None,
) -> BlockTargets:
    """Labels, validity and weights for the blocks at `anchor_positions` [N].

    labels="tokens" (default): slot k's label is `input_ids[a + k]`.
    labels="target": slot k's label is the target's greedy prediction for
        position a + k, i.e. `target_next_ids[a + k - 1]`, where
        `target_next_ids[p]` is the argmax of the target's logits at position p
        (the prediction for token p + 1), as a store would record it.
    target_topk_ids / target_topk_logprobs [T, K]: same convention (row p is the
        target's distribution for token p + 1); gathered per slot for soft KL.
    Validity always follows the sequence: `a + k < T` and `loss_mask[a + k] == 1`."""
    if gamma is None:
        gamma = default_gamma(block_size)
    length = input_ids.shape[0]
    device = input_ids.device
    positions = anchor_positions.to(device).long()[:, None] + torch.arange(block_size, device=device)[None, :]
    inside = positions < length
    safe = positions.clamp(max=length - 1)
    previous = (safe - 1).clamp(min=0)  # row predicting token `positions` in next-token convention

    valid = inside & loss_mask.to(device).bool()[safe]
    valid[:, 0] = False
    if labels == "tokens":
        block_labels = input_ids[safe]
    elif labels == "target":
        if target_next_ids is None:
            raise ValueError('labels="target" needs target_next_ids')
        block_labels = target_next_ids.to(device).long()[previous]
    else:
        raise ValueError(f'labels must be "tokens" or "target", got {labels!r}')

    weights = slot_weights(block_size, gamma).to(device)[None, :] * valid
    total = weights.sum()
    weights = weights / total if total > 0 else weights

    topk_ids = topk_logprobs = None
    if (target_topk_ids is None) != (target_topk_logprobs is None):
        raise ValueError("target_topk_ids and target_topk_logprobs go together")
    if target_topk_ids is not None:
        topk_ids = target_topk_ids.to(device).long()[previous]
        topk_logprobs = target_topk_logprobs.to(device).float()[previous]
    return BlockTargets(block_labels, valid, weights, topk_ids, topk_logprobs, total)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Weighted CE (+ optional soft KL) through a frozen head, chunk by chunk.

    For each chunk of scored rows: logits = h W^T in fp32, loss terms, the gradient
    d loss / d h = (softmax - (1-m) onehot(label) - m p_target) w W, and the
    hit flags for top-1/4/8. Only the [M, H] gradient is kept for backward."""

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, topk_ids, topk_probs, kl_mix, chunk_rows):
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        ce_sum = hidden.new_zeros((), dtype=torch.float32)
        kl_sum = hidden.new_zeros((), dtype=torch.float32)
        rows = hidden.shape[0]
        hits = torch.zeros(rows, 3, dtype=torch.bool, device=hidden.device)  # top1, top4, top8
        top = min(8, head_weight.shape[0])
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            logits = F.linear(hidden[start:end], head_weight).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            label = labels[start:end, None]
            w = weights[start:end]
            ce_sum += -(logprobs.gather(1, label).squeeze(1) * w).sum()
            if kl_mix > 0:
                p_target = topk_probs[start:end]
                ids = topk_ids[start:end]
                kl_rows = (p_target * (p_target.clamp_min(1e-30).log() - logprobs.gather(1, ids))).sum(1)
                kl_sum += (kl_rows * w).sum()
            if need_grad:
                grad_logits = logprobs.exp()
                grad_logits.scatter_add_(1, label, torch.full_like(label, -(1.0 - kl_mix), dtype=grad_logits.dtype))
                if kl_mix > 0:
                    grad_logits.scatter_add_(1, ids, -kl_mix * p_target)
                grad_logits *= w[:, None]
                grad_hidden[start:end] = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
            best = logits.topk(top, dim=-1).indices
            found = best == label
            hits[start:end, 0] = found[:, 0]
            hits[start:end, 1] = found[:, :4].any(1)
            hits[start:end, 2] = found.any(1)
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(hits)
        loss = (1.0 - kl_mix) * ce_sum + kl_mix * kl_sum
        return loss, ce_sum.detach(), kl_sum.detach(), hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kl, _grad_hits):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None, None


@dataclass
class LossOutput:
    """loss: scalar to backpropagate. ce / kl: the two terms, detached (kl is 0 when
    off). metrics: detached tensors, see `block_metrics`."""

    loss: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    metrics: dict


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: BlockTargets,
    *,
    chunk_rows: int,
    kl_mix: float = 0.0,
) -> LossOutput:
    """Loss and metrics of drafter outputs `hidden` [N, B, H] against `targets`.

    lm_head_weight: the target's frozen head [V, H] (TargetHead.lm_head.weight).
    chunk_rows: scored rows per chunk (the run's `loss.chunk_rows`); peak extra
        memory ~ chunk_rows x V fp32.
    kl_mix: weight m of the optional soft KL to the target's top-k distribution,
        loss = (1 - m) CE + m KL (default 0: hard CE only, as DFlash trains).
    Gradients flow to `hidden` only; the head stays frozen."""
    if not 0.0 <= kl_mix <= 1.0:
        raise ValueError(f"kl_mix must be in [0, 1], got {kl_mix}")
    if kl_mix > 0 and targets.topk_ids is None:
        raise ValueError("kl_mix > 0 needs target top-k ids/logprobs in BlockTargets")
    num_blocks, block_size, hidden_size = hidden.shape
    scored = targets.valid.flatten().nonzero().flatten()  # slot 0 and invalid slots cost nothing
    rows = hidden.reshape(-1, hidden_size)[scored]
    labels = targets.labels.flatten()[scored]
    weights = targets.weights.flatten()[scored].float()
    topk_ids = topk_probs = None
    if kl_mix > 0:
        topk_ids = targets.topk_ids.flatten(0, 1)[scored]
        probs = targets.topk_logprobs.flatten(0, 1)[scored].exp()
        topk_probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-30)  # renormalised top-k
    loss, ce, kl, row_hits = _ChunkedHeadLoss.apply(
        rows, lm_head_weight, labels, weights, topk_ids, topk_probs, float(kl_mix), int(chunk_rows)
    )
    hits = torch.zeros(num_blocks * block_size, 3, dtype=torch.bool, device=hidden.device)
    hits[scored] = row_hits
    hits = hits.view(num_blocks, block_size, 3)
    metrics = block_metrics(hits[..., 0], hits[..., 1], hits[..., 2], targets.valid)
    return LossOutput(loss=loss, ce=ce, kl=kl, metrics=metrics)


def block_metrics(top1: torch.Tensor, top4: torch.Tensor, top8: torch.Tensor, valid: torch.Tensor) -> dict:
    """Metrics from per-slot hit flags [N, B] and validity [N, B].

    top1/top4/top8: fraction of valid slots whose label is in the drafter's top k.
    per_position_acc: [B-1] top-1 accuracy of slots 1..B-1 (nan where no valid slot).
    tau: expected acceptance length under greedy chain verification, the mean over
        blocks with any valid slot of (correct streak from slot 1 + 1); a streak
        stops at the first wrong or invalid slot.
    num_valid / num_blocks: denominators, for averaging across steps."""
    valid = valid.bool()
    count = valid.sum()
    denominator = count.clamp_min(1).float()
    correct = top1 & valid
    per_slot_valid = valid[:, 1:].sum(0).float()
    per_position = torch.where(
        per_slot_valid > 0, correct[:, 1:].sum(0).float() / per_slot_valid.clamp_min(1), torch.full_like(per_slot_valid, math.nan)
    )
    streak = correct[:, 1:].long().cumprod(dim=1).sum(1)
    scored_blocks = valid.any(1)
    num_blocks = scored_blocks.sum()
    tau = ((streak + 1).float() * scored_blocks).sum() / num_blocks.clamp_min(1).float()
    return {
        "top1": (correct.sum() / denominator).detach(),
        "top4": ((top4 & valid).sum() / denominator).detach(),
        "top8": ((top8 & valid).sum() / denominator).detach(),
        "per_position_acc": per_position.detach(),
        "tau": tau.detach(),
        "num_valid": count.detach(),
        "num_blocks": num_blocks.detach(),
    }
