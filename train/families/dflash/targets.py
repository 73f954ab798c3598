"""What each slot of a drafted block is scored against: the DFlash block rule that
training's loss and evaluation's acceptance share.

Slot k of the block at anchor a predicts `input_ids[a + k]` (no shift), k = 1 .. B-1;
slot 0 holds the anchor and is not scored. Slot k is weighted `exp(-(k-1)/gamma)`
(early slots matter most: a draft is accepted only up to its first miss), labels with
loss_mask == 0 or past the end weigh 0. Everything here is built from `input_ids` /
`loss_mask` (or stored target predictions) only, never from the context features the
drafter reads, which may carry training noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.families.dflash.config import LossConfig

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
    weights: the static part of each slot's weight. position_weights="decay":
        exp(-(k-1)/gamma) on valid slots, normalised to sum 1 (all 0 if none);
        "dpace": 1 / (valid slots) on each valid slot, which the loss multiplies
        by `dpace_weights` (known only once the drafter's logits are).
    predecessors: the teacher-forced token before each slot, for DFlash 2's
        selector: the anchor token for slot 1 (and slot 0), then slot k-1's label.
    topk_ids / topk_logprobs: [N, B, K] target distribution per slot, for the
        optional soft-KL term; None when not given.
    weight_sum: the weights' sum before normalising (a 0-dim tensor): what the
        sequence weighs in a loss normalised over a whole optimizer step (for
        "dpace": the number of valid slots, as speculators normalises D-PACE).
    position_weights / dpace_alpha: the rule the loss applies on top of `weights`."""

    labels: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor
    weight_sum: torch.Tensor
    predecessors: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    position_weights: str = "decay"
    dpace_alpha: float = 0.5


def slot_labels(
    labels: str,
    input_ids: torch.Tensor,
    target_next_ids: torch.Tensor | None,
    safe: torch.Tensor,
    previous: torch.Tensor,
) -> torch.Tensor:
    """Each slot's label: the sequence's token at its position (`safe`), or the
    target's prediction for it (made at the position before, `previous`;
    `target_next_ids[p]` is the target's top-1 for token p + 1)."""
    if labels == "tokens":
        return input_ids[safe]
    if labels == "target" and target_next_ids is not None:
        return target_next_ids.to(safe.device).long()[previous]
    raise ValueError(f'labels must be "tokens" or "target" (with the target\'s top-k), got {labels!r}')


def normalised_weights(valid: torch.Tensor, loss: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The static weight of each slot [N, B] (`BlockTargets.weights`), normalised to
    sum 1, and their sum before normalising: decay's schedule (gamma None: the block
    size's default) or, for D-PACE, one per valid slot."""
    if loss.position_weights == "decay":
        block_size = valid.shape[1]
        gamma = default_gamma(block_size) if loss.gamma is None else loss.gamma
        weights = slot_weights(block_size, gamma).to(valid.device)[None, :] * valid
    else:
        weights = valid.to(torch.float32)
    total = weights.sum()
    return weights / total.clamp_min(1e-30), total  # no valid slot: zero weights (no read-back to ask)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchor_positions: torch.Tensor,
    block_size: int,
    loss: LossConfig,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
) -> BlockTargets:
    """Labels, validity and weights for the blocks at `anchor_positions` [N], as the
    run's `loss` section asks.

    loss.labels "tokens": slot k's label is `input_ids[a + k]`; "target": the target's
        greedy prediction for position a + k, `topk_ids[a + k - 1, 0]`: row p of the
        stored top-k [T, K] is the target's distribution for token p + 1.
    loss.kl_mix > 0: `topk_ids` / `topk_logprobs` gathered per slot for the soft KL.
    loss.position_weights, gamma (None: the block size's default), dpace_alpha: the
        slot weights (`BlockTargets.weights`).
    Validity always follows the sequence: `a + k < T` and `loss_mask[a + k] == 1`."""
    if loss.position_weights not in ("decay", "dpace"):
        raise ValueError(f'position_weights must be "decay" or "dpace", got {loss.position_weights!r}')
    if (loss.labels == "target" and topk_ids is None) or (
        loss.kl_mix > 0 and (topk_ids is None or topk_logprobs is None)
    ):
        raise ValueError("loss.labels=target / loss.kl_mix > 0 need the target's top-k of each sample")
    length = input_ids.shape[0]
    device = input_ids.device
    positions = anchor_positions.to(device).long()[:, None] + torch.arange(block_size, device=device)[None, :]
    inside = positions < length
    safe = positions.clamp(max=length - 1)
    previous = (safe - 1).clamp(min=0)  # row predicting token `positions` in next-token convention

    valid = inside & loss_mask.to(device).bool()[safe]
    valid[:, 0] = False
    block_labels = slot_labels(
        loss.labels,
        input_ids,
        topk_ids[:, 0] if topk_ids is not None and loss.labels == "target" else None,
        safe,
        previous,
    )

    weights, total = normalised_weights(valid, loss)
    slot_topk_ids = slot_topk_logprobs = None
    if loss.kl_mix > 0 and topk_ids is not None and topk_logprobs is not None:
        slot_topk_ids = topk_ids.to(device).long()[previous]
        slot_topk_logprobs = topk_logprobs.to(device).float()[previous]
    anchor_tokens = input_ids[safe[:, :1]]
    predecessors = torch.cat([anchor_tokens, anchor_tokens, block_labels[:, 1:-1]], dim=1)[:, :block_size]
    return BlockTargets(
        labels=block_labels,
        valid=valid,
        weights=weights,
        weight_sum=total,
        predecessors=predecessors,
        topk_ids=slot_topk_ids,
        topk_logprobs=slot_topk_logprobs,
        position_weights=loss.position_weights,
        dpace_alpha=float(loss.dpace_alpha),
    )
