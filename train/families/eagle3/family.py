"""EAGLE-3 behind the family interface (`train.families.family`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from train.families.eagle3 import drafting, export, plan, sizing
from train.families.eagle3.config import ARCHITECTURE, Eagle3Config
from train.families.eagle3.decoding import ChainDraftSession
from train.families.eagle3.model import Eagle3Drafter
from train.families.eagle3.step import eagle3_step
from train.families.eagle3.vocab import fill_vocabulary
from train.families.family import DraftedBlocks, Drafter, DrafterFamily, DrafterPlan, DraftSession, Served, StepResult

MIN_TOKENS = 3  # a known token, then one drafted: a chain needs x(t+1) and x(t+2) after t


def has_chain(loss_mask: torch.Tensor) -> bool:
    """Whether a sample has a chain to train: a reply token at position 2 or later."""
    return bool(loss_mask[2:].any())


class Eagle3Family(DrafterFamily):
    """Autoregressive: one token per step from one Llama layer, over a draft vocabulary."""

    name = "EAGLE-3"
    variants = (ARCHITECTURE,)
    exported_classes = (export.EXPORTED_CLASS,)

    def build(self, config) -> Drafter:
        return Eagle3Drafter(config)

    def config_from_dict(self, data: dict) -> Eagle3Config:
        return Eagle3Config.from_dict(data)

    def plan(self, model, target_path: str, target, store_layer_ids, resumed, source, log) -> DrafterPlan:
        return plan.plan_drafter(model, target_path, target, store_layer_ids, resumed, source, log)

    def load_start(self, drafter, source) -> None:
        export.load_weights(drafter, source.path)

    def start_fresh(self, drafter, store, heldout_fraction: float, log) -> None:
        fill_vocabulary(drafter, store, heldout_fraction, log)

    def check_store(self, config, loss, store, log) -> None:
        log(
            "fit: EAGLE-3 loss: forward KL to the store's target top-k renormalised over the draft vocabulary"
            if store.fingerprint.target_topk
            else "fit: EAGLE-3 loss: cross-entropy on the stored tokens (the store holds no target top-k)"
        )

    def resolved_model(self, model, config):
        return model

    def drafted_positions(self, config) -> int:
        return config.ttt_steps

    def trainable_positions(self, loss_mask: torch.Tensor, config) -> torch.Tensor:
        return torch.nonzero(loss_mask[2:].bool()).flatten() + 1

    def sample_filter(self, config) -> Callable[[torch.Tensor], bool]:
        return has_chain

    def pad_length(self, config) -> int:
        return config.ttt_steps + MIN_TOKENS

    def train_step(self, drafter, head, sample, loss, model, generator, step: int) -> StepResult:
        return eagle3_step(drafter, head, sample, loss, getattr(drafter, "module", drafter).config.ttt_steps, generator)

    def draft_blocks(self, drafter, head, sample, features, positions, config, k: int, attention: str) -> DraftedBlocks:
        return drafting.draft_blocks(drafter, head, sample, features, positions, config, k)

    def decode_path(self, config) -> str:
        return "greedy chain"

    def draft_session(self, drafter, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> DraftSession:
        return ChainDraftSession(drafter, embed_tokens, self.round_tokens(drafter.config))

    def served(self, config) -> Served:
        return Served(
            title=self.name,
            exported_class=export.EXPORTED_CLASS,
            method="eagle3",
            round_tokens=self.round_tokens(config),
            mixed_layers=False,
            cpu_serves=True,
        )

    def activation_bytes(self, config, model, act_bytes: int, sequence_tokens: int) -> dict:
        return sizing.activation_bytes(config, model, act_bytes, sequence_tokens)

    def activation_text(self, figures: dict) -> str:
        return sizing.activation_text(figures["activations"])

    def sample_flops(self, config, model, sequence_tokens: float) -> dict:
        return sizing.sample_flops(config, model, sequence_tokens)

    def paper_figures(self, drafter) -> dict:
        return sizing.figures(drafter)

    def paper_lines(self, figures: dict) -> list[str]:
        return sizing.lines(figures)

    def export(self, drafter, out_dir: Path, dtype: torch.dtype, extra_config: dict) -> Path:
        return export.export_drafter(drafter, out_dir, dtype, extra_config)

    def claims_export(self, data: dict) -> bool:
        return any(name in self.exported_classes for name in data.get("architectures") or [])

    def read_export_config(self, model_dir: Path) -> Eagle3Config:
        return export.read_drafter_config(model_dir)

    def load(self, model_dir: Path, dtype: torch.dtype | None, device) -> nn.Module:
        return export.load_drafter(model_dir, dtype, device)
