"""One EAGLE-3 training step for one sequence: training-time test unrolled over
`ttt_steps`, every position at once.

Chain t (t = 0..T-2) starts where the token x(t+1) is known and the target's
features reach t: its step k predicts x(t+2+k). The labels come first, from the
clean tokens (or the store's target top-k) and the draft vocabulary; then the drafter
runs on its own input (noise, if any, only there). Step k's loss counts 0.8**k
(SpecForge's `ploss_weight`), normalised over the sequence's weighted labels.

With the store's top-k log-probs (`target_topk`) the loss is a forward KL to the
target's distribution renormalised over the draft vocabulary (cross-entropy to it,
which differs by the teacher's constant entropy); without them it is cross-entropy on
the stored tokens. A label outside the draft vocabulary cannot be drafted and is not
scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.context_noise import add_context_noise
from train.families.family import StepResult, StepSample
from train.measures import block_metrics

STEP_DECAY = 0.8  # step k's loss weight is STEP_DECAY**k (SpecForge)


@dataclass(frozen=True)
class ChainLabels:
    """Per chain and drafted step [T-1, D]: the reference token (target ids), its
    validity, the draft-vocabulary label (-1: none) and, for the KL loss, the
    teacher's draft ids [T-1, D, K] (-1: outside) and log-probs."""

    reference: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None


def chain_labels(drafter, sample: StepSample, steps: int, use_target: bool, soft: bool) -> ChainLabels:
    """Labels of every chain's `steps` drafted tokens. `use_target`: the reference is
    the store's target top-1 (else the sequence's tokens); `soft`: keep the teacher's
    top-k for the KL loss."""
    input_ids, length = sample.input_ids.long(), sample.input_ids.shape[0]
    topk_ids, topk_logprobs = sample.topk_ids, sample.topk_logprobs
    if (use_target or soft) and topk_ids is None:
        raise ValueError("labels='target' and the KL loss need the store's target top-k, which this sample lacks")
    chains = length - 1
    rows = torch.arange(chains, device=input_ids.device)[:, None] + torch.arange(steps, device=input_ids.device) + 1
    inside = rows < length - 1  # row r predicts token r + 1, which must exist
    rows = rows.clamp(max=length - 2)
    if use_target and topk_ids is not None:
        reference = topk_ids[:, 0].to(input_ids.device).long()[rows]
    else:
        reference = input_ids[rows + 1]
    valid = inside & sample.loss_mask.to(input_ids.device).bool()[rows + 1]
    labels = drafter.draft_ids_of(reference)
    if not soft or topk_ids is None or topk_logprobs is None:
        return ChainLabels(reference, valid & (labels >= 0), labels)
    teacher_ids = drafter.draft_ids_of(topk_ids.to(input_ids.device).long()[rows])
    teacher = topk_logprobs.to(input_ids.device).float()[rows].masked_fill(teacher_ids < 0, float("-inf"))
    valid = valid & (teacher_ids >= 0).any(-1)
    return ChainLabels(reference, valid, labels, teacher_ids, torch.log_softmax(teacher, dim=-1))


def step_loss(logits: torch.Tensor, labels: ChainLabels, step: int) -> torch.Tensor:
    """Per-chain loss [T-1] of drafted step `step` (0 where not valid)."""
    valid = labels.valid[:, step]
    if labels.teacher_ids is None or labels.teacher_logprobs is None:
        per_row = F.cross_entropy(logits.float(), labels.labels[:, step].clamp_min(0), reduction="none")
    else:
        ids = labels.teacher_ids[:, step]
        teacher = labels.teacher_logprobs[:, step].exp().nan_to_num(0.0)
        per_row = -(teacher * torch.log_softmax(logits.float(), -1).gather(-1, ids.clamp_min(0))).sum(-1)
    return per_row * valid


def eagle3_step(drafter, head, sample: StepSample, loss, steps: int, generator=None) -> StepResult:
    """The loss of one sequence (`loss`: the run's section: labels, noise)."""
    bare = getattr(drafter, "module", drafter)  # the drafter under a DDP replica
    soft = sample.topk_ids is not None and sample.topk_logprobs is not None
    labels = chain_labels(bare, sample, steps, loss.labels == "target", soft)
    features = add_context_noise(sample.context_features, loss.noise, generator)
    outputs = drafter(features, sample.input_ids.long(), head.embed_tokens, steps)
    decay = STEP_DECAY ** torch.arange(steps, device=labels.valid.device, dtype=torch.float32)
    weight = (labels.valid.float() * decay).sum()
    total = torch.zeros((), device=weight.device)
    hits = {k: torch.zeros_like(labels.valid) for k in (1, 4, 8)}
    for step, hidden in enumerate(outputs):
        logits = bare.lm_head(hidden)
        total = total + step_loss(logits, labels, step).sum() * decay[step]
        top = bare.target_ids_of(logits.detach().topk(min(8, logits.shape[-1]), dim=-1).indices)
        for k in hits:
            hits[k][:, step] = (top[:, :k] == labels.reference[:, step, None]).any(-1)
    metrics = chain_metrics(hits, labels.valid)
    return StepResult(total / weight.clamp_min(1e-9), weight.detach(), metrics, labels.valid.sum(0))


def chain_metrics(hits: dict[int, torch.Tensor], valid: torch.Tensor) -> dict:
    """`block_metrics` of chains [N, D]: a leading column stands for the known token."""

    def with_anchor(flags: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(flags[:, :1]), flags], dim=1)

    top1, top4, top8 = (with_anchor(hits[k] & valid) for k in (1, 4, 8))
    return block_metrics(top1, top4, top8, with_anchor(valid))
