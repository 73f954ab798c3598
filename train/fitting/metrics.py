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

_SUMMED = (
    "loss",  # each sequence's loss times its label weight
    "weight",  # label weights (BlockTargets.weight_sum) summed
    "valid",
    "top1",
    "top4",
    "top8",
    "blocks",
    "tau",
    "selector_valid",  # DFlash 2: valid slots with recall@K / selector flags (0 for DFlash)
    "recall",  # label among the selector's top-K candidates
    "selector_hits",  # teacher-forced selector's argmax is the label
)


@dataclass
class MetricSums:
    """Sums over sequences, turned into means when a line is logged.

    The counts (`sequences`, `tokens`) are the host's; every figure a step computes
    stays where it was computed, in one float64 vector (`totals`: `_SUMMED`, then the
    per-position hits and valid slots), so adding a sequence reads nothing back from
    the GPU: the host runs ahead of it until a line is logged (`means`)."""

    positions: int  # drafted positions a chain scores (the family's `drafted_positions`)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sequences: int = 0
    tokens: int = 0
    totals: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.totals = torch.zeros(len(_SUMMED) + 2 * self.positions, dtype=torch.float64, device=self.device)

    def add(self, result: StepResult, num_tokens: int) -> None:
        """One sequence's training step and its token count. The loss counts by the
        sequence's label weight, so the mean is over all weighted labels, as the
        step's loss is."""
        metrics, device = result.metrics, self.totals.device

        def value(x) -> torch.Tensor:
            return torch.as_tensor(x, device=device).detach().to(torch.float64).reshape(())

        weight, valid, blocks = value(result.weight), value(metrics["num_valid"]), value(metrics["num_blocks"])
        selector = "recall_at_k" in metrics
        zero = torch.zeros((), dtype=torch.float64, device=device)
        scalars = [
            value(result.loss) * weight,
            weight,
            valid,
            value(metrics["top1"]) * valid,
            value(metrics["top4"]) * valid,
            value(metrics["top8"]) * valid,
            blocks,
            value(metrics["tau"]) * blocks,
            valid if selector else zero,
            value(metrics["recall_at_k"]) * valid if selector else zero,
            value(metrics["selector_acc"]) * valid if selector else zero,
        ]
        slot_valid = result.position_valid.detach().to(device, torch.float64)
        slot_hits = metrics["per_position_acc"].detach().to(device, torch.float64).nan_to_num(0.0) * slot_valid
        self.totals += torch.cat([torch.stack(scalars), slot_hits, slot_valid])
        self.sequences += 1
        self.tokens += num_tokens

    def merge(self, more: "MetricSums") -> "MetricSums":
        """Add another sum into this one (e.g. an optimizer step's into the log interval's)."""
        self.sequences += more.sequences
        self.tokens += more.tokens
        self.totals += more.totals.to(self.totals.device)
        return self

    def weight(self) -> torch.Tensor:
        """The label weights summed (0-dim, where the figures are): a step's loss normaliser."""
        return self.totals[_SUMMED.index("weight")]

    def as_vector(self) -> torch.Tensor:
        """The counts and every sum in one float64 vector (summed over ranks in one all_reduce)."""
        counts = torch.tensor([self.sequences, self.tokens], dtype=torch.float64, device=self.totals.device)
        return torch.cat([counts, self.totals])

    @classmethod
    def from_vector(cls, positions: int, vector: torch.Tensor) -> "MetricSums":
        """`as_vector`'s inverse; the figures stay on the vector's device, the counts are read."""
        sums = cls(positions, vector.device)
        sequences, tokens = vector[:2].tolist()
        sums.sequences, sums.tokens = int(round(sequences)), int(round(tokens))
        sums.totals = vector[2:].clone()
        return sums

    def means(self, prefix: str = "") -> dict:
        """The log's means (the figures read from the device once); DFlash 2 adds `recall_at_k`
        (label in the unary top-K) and `selector_acc` (teacher-forced selector right), over
        valid slots as `acc` is."""
        values = self.totals.tolist()
        s = dict(zip(_SUMMED, values))
        n = len(_SUMMED)
        hits, slots = values[n : n + self.positions], values[n + self.positions :]
        valid = max(s["valid"], 1.0)
        per_position = [round(h / v, 6) if v > 0 else None for h, v in zip(hits, slots)]
        selector = (
            {}
            if s["selector_valid"] <= 0
            else {
                f"{prefix}recall_at_k": s["recall"] / s["selector_valid"],
                f"{prefix}selector_acc": s["selector_hits"] / s["selector_valid"],
            }
        )
        return {
            f"{prefix}loss": s["loss"] / s["weight"] if s["weight"] > 0 else 0.0,
            f"{prefix}acc": s["top1"] / valid,
            f"{prefix}top4_acc": s["top4"] / valid,
            f"{prefix}top8_acc": s["top8"] / valid,
            f"{prefix}per_position_acc": per_position,
            f"{prefix}tau_per_position": s["tau"] / max(s["blocks"], 1.0),
            **selector,
        }


class LogInterval:
    """The steps since the last logged line: their metric sums, time and loader wait,
    turned into one line's training figures."""

    def __init__(self, positions: int, wait_seconds, device: torch.device):
        self.positions, self.wait_seconds = positions, wait_seconds  # wait_seconds(): the loaders' total so far
        self.device = device  # where the steps' figures are summed
        self.sums = MetricSums(positions, device)
        self.restart_clock()

    def restart_clock(self) -> None:
        """After any written line (an evaluation's too): rates leave out the time it took."""
        self.began, self.waited = time.perf_counter(), self.wait_seconds()

    def figures(self) -> dict:
        """The line's means and rates; the next interval starts from here."""
        elapsed = max(time.perf_counter() - self.began, 1e-9)
        sums, waited = self.sums, self.wait_seconds() - self.waited
        self.sums = MetricSums(self.positions, self.device)
        return {
            **sums.means(),
            "tokens_per_s": sums.tokens / elapsed,
            "sequences_per_s": sums.sequences / elapsed,
            "loader_wait_frac": waited / elapsed,
        }
