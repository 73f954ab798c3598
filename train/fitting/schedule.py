"""The learning-rate schedule: linear warmup, then cosine (or constant).

One function, `lr_at`, used by the trainer to set the LR of every optimizer step
and by `diagnose` to check a run's logged LR against its config. Plain Python,
no torch."""

from __future__ import annotations

import math


def warmup_steps(total_steps: int, optim) -> int:
    """Optimizer steps of linear warmup: `optim.warmup_fraction` of the run."""
    return int(round(optim.warmup_fraction * total_steps))


def lr_at(step: int, total_steps: int, optim) -> float:
    """LR of optimizer step `step` (0-based) of a `total_steps` run under
    `optim` (train.fitting.config.OptimConfig): linear warmup to `optim.lr` over
    `warmup_steps`, then cosine down to `lr * min_lr_ratio` at the end, or
    constant. A log line for step S (steps done) carries `lr_at(S - 1)`."""
    warmup = warmup_steps(total_steps, optim)
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
