"""DFlash and DFlash 2 behind the family interface (`train.families.family`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from train.families.dflash import drafting, export, plan, sizing
from train.families.dflash.anchors import anchor_candidates, has_anchor
from train.families.dflash.build import build_drafter
from train.families.dflash.decoding import BlockDraftSession
from train.families.dflash.init_from import load_start_weights
from train.families.dflash.model import DrafterConfig
from train.families.dflash.step import dflash_step
from train.families.dflash.variants import KINDS, kind_named
from train.families.family import (
    DraftedBlocks,
    Drafter,
    DrafterFamily,
    DrafterPlan,
    DraftSession,
    Served,
    StartSource,
    StepResult,
    StepSample,
)


class DFlashFamily(DrafterFamily):
    """Block diffusion: B-1 tokens drafted at once after an anchor."""

    name = "DFlash"
    variants = tuple(KINDS)
    exported_classes = tuple(kind.exported_class for kind in KINDS.values())

    def build(self, config) -> Drafter:
        return build_drafter(config)

    def config_from_dict(self, data: dict) -> DrafterConfig:
        return DrafterConfig.from_dict(data)

    def plan(
        self, model, target_path: str, target, store_layer_ids: list[int] | None, resumed, source, log
    ) -> DrafterPlan:
        return plan.plan_drafter(model, target_path, target, store_layer_ids, resumed, source, log)

    def load_start(self, drafter, source: StartSource) -> None:
        load_start_weights(drafter, source)

    def start_fresh(self, drafter, store, heldout_fraction: float, log) -> None:
        return None  # a DFlash drafter takes nothing from the store but its samples

    def check_store(self, config, loss, store, log) -> None:
        plan.check_store(config, loss, store)

    def resolved_model(self, model, config):
        return dataclasses.replace(model, mask_token_id=config.mask_token_id)

    def drafted_positions(self, config) -> int:
        return config.block_size - 1

    def trainable_positions(self, loss_mask: torch.Tensor, config) -> torch.Tensor:
        return anchor_candidates(loss_mask, config.block_size)

    def sample_filter(self, config) -> Callable[[torch.Tensor], bool]:
        return partial(has_anchor, config.block_size)

    def planned_filter(self, config) -> Callable[[int, int], bool]:
        # B loss tokens: the first lies at <= length - B, an anchor. Fewer may still hold one
        # (an earlier turn's, far from the end): such samples train but are not counted.
        return lambda tokens, loss_tokens: loss_tokens >= config.block_size

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

    def draft_session(self, drafter, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> DraftSession:
        return BlockDraftSession(drafter, embed_tokens, lm_head, self.round_tokens(drafter.config))

    def served(self, config) -> Served:
        kind = kind_named(config.architecture)
        return Served(
            title=kind.title,
            exported_class=kind.exported_class,
            method="dflash",
            round_tokens=self.round_tokens(config),
            mixed_layers=len(set(config.layer_types)) > 1,
            cpu_serves=kind.vllm_cpu_serves,
        )

    def activation_bytes(self, config, model, act_bytes: int, sequence_tokens: int) -> dict:
        return sizing.activation_bytes(model, config, act_bytes, sequence_tokens)

    def activation_text(self, figures: dict) -> str:
        return sizing.activation_text(figures["activations"], figures["drafter_layers"])

    def sample_flops(self, config, model, sequence_tokens: float) -> dict:
        return sizing.sample_flops(model, config, sequence_tokens)

    def paper_figures(self, drafter) -> dict:
        return sizing.figures(drafter)

    def paper_lines(self, figures: dict) -> list[str]:
        return sizing.lines(figures)

    def export(self, drafter, out_dir: Path, dtype: torch.dtype, extra_config: dict) -> Path:
        return export.export_drafter(drafter, out_dir, dtype, extra_config)

    def claims_export(self, data: dict) -> bool:
        return "dflash_config" in data or any(name in self.exported_classes for name in data.get("architectures") or [])

    def read_export_config(self, model_dir: Path) -> DrafterConfig:
        return export.read_drafter_config(model_dir)

    def load(self, model_dir: Path, dtype: torch.dtype | None, device) -> nn.Module:
        return export.load_drafter(model_dir, dtype, device)
