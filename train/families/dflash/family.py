"""DFlash and DFlash 2 behind the family interface (`train.families.family`)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from train.families.dflash import drafting
from train.families.dflash.anchors import anchor_candidates, has_anchor
from train.families.dflash.build import build_drafter
from train.families.dflash.step import dflash_step
from train.families.dflash.variants import KINDS, kind_named
from train.families.family import DraftedBlocks, DrafterFamily, StepResult, StepSample


class DFlashFamily(DrafterFamily):
    """Block diffusion: B-1 tokens drafted at once after an anchor."""

    name = "DFlash"
    variants = tuple(KINDS)

    def build(self, config) -> nn.Module:
        return build_drafter(config)

    def drafted_positions(self, config) -> int:
        return config.block_size - 1

    def trainable_positions(self, loss_mask: torch.Tensor, config) -> torch.Tensor:
        return anchor_candidates(loss_mask, config.block_size)

    def sample_filter(self, config):
        return partial(has_anchor, config.block_size)

    def pad_length(self, config) -> int:
        return 2 * config.block_size

    def train_step(
        self, drafter, head, sample: StepSample, loss, model, generator: torch.Generator | None, step: int
    ) -> StepResult:
        output, _, targets = dflash_step(drafter, head, sample, loss, model, generator, step=step)
        return StepResult(output.loss, targets.weight_sum, output.metrics, targets.valid[:, 1:].sum(0))

    def draft_blocks(
        self, drafter, head, sample, features: torch.Tensor, positions: torch.Tensor, config, k: int, attention: str
    ) -> DraftedBlocks:
        return drafting.draft_blocks(drafter, head, sample, features, positions, config, k, attention)

    def decode_path(self, config) -> str:
        return kind_named(config.architecture).decode_path
