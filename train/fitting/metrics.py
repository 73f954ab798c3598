"""Training metrics summed over sequences and turned into the log's means.

`tau_per_position` here is chain acceptance over the step's randomly drawn
training positions (DFlash: anchors), pooled over drafted chains: a per-position
estimate, not the decode-time `tau` (`train.evaluation.evaluate`), which only a
rollout gives. What one sequence adds is its family's `StepResult`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from train.families.family import StepResult

_SCALARS = (
    "sequences",
    "tokens",
    "loss",
    "weight",
    "valid",
    "top1",
    "top4",
    "top8",
    "blocks",
    "tau",
    "selector_valid",
    "recall",
    "selector_hits",
)


@dataclass
class MetricSums:
    """Sums over sequences, turned into means when a line is logged."""

    positions: int  # drafted positions a chain scores (the family's `drafted_positions`)
    sequences: int = 0
    tokens: int = 0
    loss: float = 0.0  # each sequence's loss times its label weight
    weight: float = 0.0  # label weights (BlockTargets.weight_sum) summed
    valid: float = 0.0
    top1: float = 0.0
    top4: float = 0.0
    top8: float = 0.0
    blocks: float = 0.0
    tau: float = 0.0
    selector_valid: float = 0.0  # DFlash 2: valid slots with recall@K / selector flags (0 for DFlash)
    recall: float = 0.0  # label among the selector's top-K candidates
    selector_hits: float = 0.0  # teacher-forced selector's argmax is the label
    slot_hits: torch.Tensor = field(init=False)
    slot_valid: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.slot_hits = torch.zeros(self.positions, dtype=torch.float64)
        self.slot_valid = torch.zeros(self.positions, dtype=torch.float64)

    def add(self, result: StepResult, num_tokens: int) -> None:
        """One sequence's training step and its token count. The loss counts by the
        sequence's label weight, so the mean is over all weighted labels, as the
        step's loss is."""
        loss, metrics = float(result.loss.detach()), result.metrics
        weight = float(result.weight)
        valid = float(metrics["num_valid"])
        blocks = float(metrics["num_blocks"])
        per_slot_valid = result.position_valid.double().cpu()
        per_position = metrics["per_position_acc"].double().cpu().nan_to_num(0.0)
        self.sequences += 1
        self.tokens += num_tokens
        self.loss += loss * weight
        self.weight += weight
        self.valid += valid
        self.top1 += float(metrics["top1"]) * valid
        self.top4 += float(metrics["top4"]) * valid
        self.top8 += float(metrics["top8"]) * valid
        self.blocks += blocks
        self.tau += float(metrics["tau"]) * blocks
        if "recall_at_k" in metrics:
            self.selector_valid += valid
            self.recall += float(metrics["recall_at_k"]) * valid
            self.selector_hits += float(metrics["selector_acc"]) * valid
        self.slot_hits += per_position * per_slot_valid
        self.slot_valid += per_slot_valid

    def merge(self, more: "MetricSums") -> "MetricSums":
        """Add another sum into this one (e.g. an optimizer step's into the log interval's)."""
        for name in _SCALARS:
            setattr(self, name, getattr(self, name) + getattr(more, name))
        self.slot_hits += more.slot_hits
        self.slot_valid += more.slot_valid
        return self

    def as_vector(self) -> torch.Tensor:
        """Every sum in one float64 vector (summed over ranks in one all_reduce)."""
        scalars = torch.tensor([float(getattr(self, name)) for name in _SCALARS], dtype=torch.float64)
        return torch.cat([scalars, self.slot_hits, self.slot_valid])

    @classmethod
    def from_vector(cls, positions: int, vector: torch.Tensor) -> "MetricSums":
        sums = cls(positions)
        n, slots = len(_SCALARS), positions
        for name, value in zip(_SCALARS, vector[:n].tolist()):
            setattr(sums, name, int(round(value)) if name in ("sequences", "tokens") else value)
        sums.slot_hits = vector[n : n + slots].clone()
        sums.slot_valid = vector[n + slots : n + 2 * slots].clone()
        return sums

    def means(self, prefix: str = "") -> dict:
        """The log's means; DFlash 2 adds `recall_at_k` (label in the unary top-K) and
        `selector_acc` (teacher-forced selector right), over valid slots as `acc` is."""
        valid = max(self.valid, 1.0)
        per_position = [round(float(h / v), 6) if v > 0 else None for h, v in zip(self.slot_hits, self.slot_valid)]
        selector = (
            {}
            if self.selector_valid <= 0
            else {
                f"{prefix}recall_at_k": self.recall / self.selector_valid,
                f"{prefix}selector_acc": self.selector_hits / self.selector_valid,
            }
        )
        return {
            f"{prefix}loss": self.loss / self.weight if self.weight > 0 else 0.0,
            f"{prefix}acc": self.top1 / valid,
            f"{prefix}top4_acc": self.top4 / valid,
            f"{prefix}top8_acc": self.top8 / valid,
            f"{prefix}per_position_acc": per_position,
            f"{prefix}tau_per_position": self.tau / max(self.blocks, 1.0),
            **selector,
        }


class LogInterval:
    """The steps since the last logged line: their metric sums, time and loader wait,
    turned into one line's training figures."""

    def __init__(self, positions: int, wait_seconds):
        self.positions, self.wait_seconds = positions, wait_seconds  # wait_seconds(): the loaders' total so far
        self.sums = MetricSums(positions)
        self.restart_clock()

    def restart_clock(self) -> None:
        """After any written line (an evaluation's too): rates leave out the time it took."""
        self.began, self.waited = time.perf_counter(), self.wait_seconds()

    def figures(self) -> dict:
        """The line's means and rates; the next interval starts from here."""
        elapsed = max(time.perf_counter() - self.began, 1e-9)
        sums, waited = self.sums, self.wait_seconds() - self.waited
        self.sums = MetricSums(self.positions)
        return {
            **sums.means(),
            "tokens_per_s": sums.tokens / elapsed,
            "sequences_per_s": sums.sequences / elapsed,
            "loader_wait_frac": waited / elapsed,
        }
