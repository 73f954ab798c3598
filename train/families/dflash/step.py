"""One DFlash training step for one sequence, in the order that keeps it honest:

1. draw anchors from the loss mask,
2. build labels, weights and metric references from the clean tokens / stored
   target predictions (`BlockTargets`),
3. only then make the drafter's input, optionally with noise on the context
   features (a new tensor; the caller's features are untouched),
4. run the drafter and score it through the frozen lm_head.

Noise added to a tensor that also produces the target logits corrupts the targets
(a real run plateaued on it); here noise is created after the targets exist and
flows only into the drafter.
"""

from __future__ import annotations

import torch

from train.context_noise import add_context_noise
from train.families.dflash.anchors import sample_anchors
from train.families.dflash.config import LossConfig, ModelConfig
from train.families.dflash.loss import LossOutput, dflash_loss
from train.families.dflash.selector_loss import selector_weight_at
from train.families.dflash.targets import BlockTargets, block_targets
from train.families.family import StepSample


def dflash_step(
    drafter,
    head,
    sample: StepSample,
    loss: LossConfig,
    model_config: ModelConfig,
    generator: torch.Generator | None = None,
    step: int = 0,
) -> tuple[LossOutput, torch.Tensor, BlockTargets]:
    """Loss for one sequence. Returns (LossOutput, anchor_positions, BlockTargets).

    drafter: train.families.dflash.model.DFlashDrafter; head: train.target_head.TargetHead.
    sample: its top-k is read only for labels="target" (top-1) or kl_mix > 0.
    loss: the run's `loss` section (gamma, position_weights, labels, kl_mix, noise,
        chunk_rows); pass `dataclasses.replace(loss, noise=0.0)` to score without noise.
    model_config: the run's `model` section (num_anchors, attention).
    generator: one seeded torch.Generator for the run: anchors (and noise) are
        redrawn every step, reproducibly.
    step: the optimizer step (0-based), for `loss.selector_warmup_steps`.
    A DFlash 2 drafter (bare or DDP-wrapped) adds its candidate selector's K-way CE
    (`loss.selector_weight`, ramped) and the recall@K / selector accuracy metrics."""
    block_size, input_ids = drafter.config.block_size, sample.input_ids
    anchors = sample_anchors(sample.loss_mask, block_size, model_config.num_anchors, generator)
    anchor_positions = anchors.to(input_ids.device)
    targets = block_targets(
        input_ids, sample.loss_mask, anchor_positions, block_size, loss, sample.topk_ids, sample.topk_logprobs
    )
    drafter_input = add_context_noise(sample.context_features, loss.noise, generator)
    hidden = drafter(drafter_input, input_ids, anchor_positions, head.embed_tokens, attention=model_config.attention)
    bare = getattr(drafter, "module", drafter)  # the drafter under a DDP replica
    selector = bare.candidate_selector if bare.kind.has_selector else None
    output = dflash_loss(
        hidden,
        head.lm_head.weight,
        targets,
        chunk_rows=loss.chunk_rows,
        kl_mix=loss.kl_mix,
        selector=selector,
        selector_top_k=bare.config.selector_top_k if selector else 0,
        selector_weight=selector_weight_at(step, loss.selector_weight, loss.selector_warmup_steps),
    )
    return output, anchor_positions, targets
