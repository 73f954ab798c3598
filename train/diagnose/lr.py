"""The learning-rate check of `train.diagnose.report`: the logged LR against the run's
own schedule (its config's `optim` section and length, `train.fitting.schedule`), the
warmup peak at the configured step with the configured value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from train.config import RunConfig
from train.diagnose.checks import Finding
from train.fitting.config import OptimConfig
from train.fitting.runlog import series
from train.fitting.schedule import lr_at, warmup_steps


@dataclass
class LRSchedule:
    """The schedule a run's LR must follow: its `optim` section over its length."""

    optim: OptimConfig
    total_steps: int
    estimated: list[str] = field(default_factory=list)  # fields inferred from the log rather than read

    @property
    def warmup_steps(self) -> int:
        return warmup_steps(self.total_steps, self.optim)

    def expected(self, logged_step: float) -> float:
        """The LR on the log line of `logged_step` (steps done): that of optimizer step `logged_step - 1`."""
        return lr_at(max(int(logged_step) - 1, 0), self.total_steps, self.optim)

    def expected_array(self, steps: np.ndarray) -> np.ndarray:
        return np.array([self.expected(s) for s in np.asarray(steps)], dtype=np.float64)

    def summary(self) -> dict:
        optim = self.optim
        return {
            "lr": optim.lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "schedule": optim.schedule,
            "min_lr": optim.lr * optim.min_lr_ratio,
            "estimated": list(self.estimated),
        }


def lr_schedule(config: RunConfig | None, records: Sequence[dict] = ()) -> LRSchedule | None:
    """The run's schedule: `train.max_steps`, else `train.epochs` x the steps per
    epoch seen in the log's `epoch`. None without a config or a way to its length."""
    if config is None:
        return None
    if config.train.max_steps is not None:
        return LRSchedule(config.optim, config.train.max_steps)
    per_epoch = _steps_per_epoch(records)
    if per_epoch is None:
        return None
    return LRSchedule(config.optim, round(config.train.epochs * per_epoch), ["total_steps"])


def _steps_per_epoch(records: Sequence[dict]) -> float | None:
    steps, epochs = series(records, "epoch")
    if not len(steps):
        return None
    if np.any(epochs != np.floor(epochs)):  # fractional epochs: step / epoch
        last = np.nonzero(epochs > 0)[0]
        return float(steps[last[-1]] / epochs[last[-1]]) if len(last) else None
    changes = np.nonzero(np.diff(epochs) > 0)[0]
    return float(steps[changes[0] + 1] - steps[0]) if len(changes) else None


# -- the LR check ------------------------------------------------------------------------


MIN_LR_POINTS = 5  # logged LR values below which the schedule is too short to judge


def check_lr(records, schedule: LRSchedule | None, peak_tolerance: float = 0.02, shape_tolerance: float = 0.05):
    """Compare the logged LR with the run's schedule. Allows one step of
    off-by-one (a logged LR may be the value before or after the optimizer step).
    Judged only with `MIN_LR_POINTS` values, and by what the log can show: the
    peak against the highest LR the schedule gives at the logged steps (a log
    line every 10 steps may never land on the peak itself), the warmup's end only
    when the log resolves it; `max_error`, printed in the details, is the verdict's
    own measure."""
    steps, lrs = series(records, "lr")
    info: dict = {"checked": False}
    if not len(steps):
        info["note"] = "no lr in the log"
        return info, []
    peak_index = int(np.argmax(lrs >= lrs.max() * (1 - 1e-6)))
    info.update(peak_step=int(steps[peak_index]), peak_lr=float(lrs.max()))
    if schedule is None:
        info["note"] = "no usable config (lr, warmup, total steps): schedule not checked"
        return info, []
    if len(steps) < MIN_LR_POINTS:
        info["note"] = f"too short to judge ({len(steps)} logged LR value(s), {MIN_LR_POINTS} needed)"
        return info, []
    info.update(checked=True, config=schedule.summary())
    lr = schedule.optim.lr
    findings = []
    interval = float(np.median(np.diff(steps)))
    expected = np.stack([schedule.expected_array(steps + d) for d in (-1, 0, 1)], axis=1)
    # Where the logged LR first reaches the configured peak (the max itself may
    # sit a step later when warmup ends between log lines).
    expected_peak = schedule.warmup_steps
    step_tol = max(2.0, interval + 1, 0.02 * schedule.warmup_steps)
    problems = []
    warmup_seen = schedule.optim.schedule != "constant" and schedule.warmup_steps > interval
    if warmup_seen and abs(info["peak_step"] - expected_peak) > step_tol:
        problems.append(f"peaks at step {info['peak_step']}, the config's warmup ends at step {expected_peak}")
    highest = float(expected.max())  # the highest LR the schedule gives at the logged steps
    if abs(info["peak_lr"] - highest) > peak_tolerance * lr:
        problems.append(
            f"peaks at {info['peak_lr']:.3g}, the config gives at most {highest:.3g} at the logged steps"
            + (f" (peak {lr:.3g})" if abs(highest - lr) > 1e-12 * lr else "")
        )
    error = np.abs(expected - lrs[:, None]).min(axis=1) / lr
    worst = int(np.argmax(error))
    info.update(max_error=float(error[worst]), worst_step=int(steps[worst]))
    if error[worst] > shape_tolerance:
        problems.append(
            f"at step {int(steps[worst])} it is {lrs[worst]:.3g} where the configured warmup + "
            f"{schedule.optim.schedule} gives "
            f"{schedule.expected(steps[worst]):.3g} ({error[worst]:.0%} of the peak off)"
        )
    if problems:
        estimated = f" (estimated: {', '.join(schedule.estimated)})" if schedule.estimated else ""
        findings.append(
            Finding(
                "lr_schedule",
                "Learning-rate schedule differs from the config" + estimated + ": " + "; ".join(problems) + ".",
                sorted({info["peak_step"], expected_peak, int(steps[worst])}),
            )
        )
    return info, findings
