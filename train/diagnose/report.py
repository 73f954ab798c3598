"""Training diagnostics over a run's `train_log.jsonl`: is the run still improving,
did it fall off a cliff, does the learning rate follow the config, is the loss
distribution healthy, what happens at epoch boundaries.

These are the analyses that explain a plateaued run (DESIGN.md, what earlier versions taught):

- improvement per 1K steps in successive step windows (least-squares slope of the
  metric inside each window), and a plateau verdict: the last window gains less
  than `plateau_ratio` of the best window (or nothing at all); the plateau's
  start is located with a hinge fit (rise, then flat);
- instability cliffs: the mean accuracy over the `cliff_window` records after a
  step is more than `cliff_drop` below the mean over the records before it;
- the LR schedule against the run's own config (RUN/config.yaml, read with
  `train.config_loading.load_config`): the warmup peak at the configured step with the
  configured value, and every logged LR on the trainer's own schedule
  (`train.fitting.schedule.lr_at`);
- the loss distribution: the share of steps above twice the running median, and a
  bimodality flag (a two-Gaussian mixture on log(loss / running median) that
  wins by BIC with well separated, non-negligible components);
- loss deltas at epoch boundaries (mean over the records just before and after).

`diagnose(run)` returns a `Diagnosis`; `render()` gives a plain-language verdict
first and the details after. Plots are `train.diagnose.plot`, the comparison of
two runs `train.diagnose.compare`; the log's format is `train.fitting.runlog`.

Log records are dicts with at least `step`; the other keys are used when present:
`loss`, `acc`, `top4_acc`, `top8_acc`, `tau_per_position`, `lr`, `epoch`, and
held-out evaluation keys: `eval_tau` (decode-time rollout), `eval_ddtree_<budget>`,
`eval_tau_per_position` (`train.fitting.periodic_eval`), `heldout_tau_per_position`,
`heldout_acc` (the trainer's held-out pass), and DFlash 2's `recall_at_k` /
`selector_acc` (and their `heldout_` twins). Logs written before tau meant the
rollout are read with their per-position keys renamed (`train.fitting.runlog`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from store_schema.root import read_root
from train.config import CONFIG_FILE, RunConfig
from train.config_error import ConfigError
from train.config_loading import load_config
from train.diagnose.checks import (
    Finding,
    check_epochs,
    check_learning,
    check_loss_distribution,
    check_plateau,
    find_cliffs,
    improvement_windows,
    primary_metric,
)
from train.fitting.config import OptimConfig
from train.fitting.runlog import TAU_KEYS, Log, accuracy_key, ddtree_keys_by_budget, read_log, series
from train.fitting.schedule import lr_at, warmup_steps

# DFlash 2's selector (train.fitting.metrics): the label among the unary top-K, and the
# teacher-forced selector's pick right; on training and held-out data
SELECTOR_KEYS = ("recall_at_k", "selector_acc", "heldout_recall_at_k", "heldout_selector_acc")


# -- the run's config ----------------------------------------------------------------------


def store_vocab_size(config: RunConfig | None) -> int | None:
    """The vocabulary of the run's store (its fingerprint): ln of it is the loss of a
    uniform guess. None when the store cannot be read from here, or when the loss is
    not on that scale: D-PACE multiplies each slot's CE by its share of the accepted
    length (up to the block size), so its loss has no uniform-guess reference."""
    if config is None or not config.store or config.loss.position_weights == "dpace":
        return None
    try:
        return read_root(config.store).fingerprint.vocab_size
    except (OSError, ValueError):
        return None


def read_run_config(run) -> RunConfig | None:
    """The run's own config, RUN/config.yaml as `fit` saved it (`run` is the run
    directory or its train_log.jsonl); None when the run has none."""
    path = Path(run)
    path = (path.parent if path.is_file() else path) / CONFIG_FILE
    return load_config(path) if path.is_file() else None


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
        return {"lr": optim.lr, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps,
                "schedule": optim.schedule, "min_lr": optim.lr * optim.min_lr_ratio, "estimated": list(self.estimated)}


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
        problems.append(f"peaks at {info['peak_lr']:.3g}, the config gives at most {highest:.3g} at the logged steps"
                        + (f" (peak {lr:.3g})" if abs(highest - lr) > 1e-12 * lr else ""))
    error = np.abs(expected - lrs[:, None]).min(axis=1) / lr
    worst = int(np.argmax(error))
    info.update(max_error=float(error[worst]), worst_step=int(steps[worst]))
    if error[worst] > shape_tolerance:
        problems.append(
            f"at step {int(steps[worst])} it is {lrs[worst]:.3g} where the configured warmup + {schedule.optim.schedule} gives "
            f"{schedule.expected(steps[worst]):.3g} ({error[worst]:.0%} of the peak off)"
        )
    if problems:
        estimated = f" (estimated: {', '.join(schedule.estimated)})" if schedule.estimated else ""
        findings.append(Finding(
            "lr_schedule",
            "Learning-rate schedule differs from the config" + estimated + ": " + "; ".join(problems) + ".",
            sorted({info["peak_step"], expected_peak, int(steps[worst])}),
        ))
    return info, findings


# -- the diagnosis -------------------------------------------------------------------------


@dataclass
class Diagnosis:
    run: str
    steps: list[int]  # first and last logged step
    records: int
    findings: list[Finding]
    plateau: dict
    improvement: dict  # metric -> windows
    cliffs: list[dict]
    lr: dict
    loss: dict
    epochs: list[dict]
    notes: list[str] = field(default_factory=list)
    learning: dict = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not self.findings

    def verdict(self) -> str:
        if not self.findings:
            state = self.plateau.get("verdict", "unknown")
            metric = self.plateau.get("metric", "the metric")
            if state in ("unknown", "too short"):
                head, parts = (f"Too short to judge improvement ({self.records} records, steps {self.steps[0]}-"
                               f"{self.steps[1]}); nothing wrong found: "), []
            elif state == "schedule ending":
                share, since = self.plateau["lr_to_peak"], self.plateau["since_step"]
                head, parts = "No problems found: ", [
                    f"{metric} gains little from step {since}, where the LR is down to {share:.0%} of its peak: "
                    "the schedule is ending, not a plateau"]
            elif state == "held-out improving":
                rise = self.plateau["heldout"]
                head, parts = "No problems found: ", [
                    f"{metric} gains little from step {self.plateau['since_step']}, but {rise['key']} still rose "
                    f"{rise['from']:.3g} -> {rise['to']:.3g} (steps {rise['from_step']}-{rise['to_step']}): "
                    "still improving, not a plateau"]
            else:
                head, parts = "No problems found: ", [f"{metric} {state}"]
            if self.learning.get("learning"):
                parts.insert(0, f"it learns (loss {self.learning['loss_start']:.3g} -> {self.learning['loss_end']:.3g})")
            parts.append("no cliffs")
            parts.append("LR matches the config" if self.lr.get("checked") else
                         "LR too short to judge" if "too short" in self.lr.get("note", "") else "LR not checked (no config)")
            parts.append("loss distribution unimodal" if "mixture" in self.loss else "loss distribution too short to judge")
            parts.append("no epoch-boundary jumps" if self.epochs else "no epoch boundary logged")
            return head + ", ".join(parts) + "."
        kinds = sorted({f.kind for f in self.findings}, key=[f.kind for f in self.findings].index)
        return f"{len(self.findings)} problem(s) found ({', '.join(kinds)})."

    def to_dict(self) -> dict:
        data = asdict(self)
        data["verdict"] = self.verdict()
        data["healthy"] = self.healthy
        return data

    def render(self) -> str:
        lines = [f"Run {self.run}: steps {self.steps[0]}-{self.steps[1]} ({self.records} records)", "",
                 "VERDICT: " + self.verdict()]
        for finding in self.findings:
            lines.append(f"  - {finding.message}")
        lines += ["", "Details", "-------"]
        lines.append(self._learning_line())
        lines.append(f"Improvement per 1K steps (window {self.plateau.get('window', '-')} steps):")
        for metric, windows in self.improvement.items():
            cells = "  ".join(f"{w['start']}-{w['end'] - 1}: {w['gain_per_1k']:+.4f}" for w in windows)
            mark = " (verdict metric)" if metric == self.plateau.get("metric") else ""
            lines.append(f"  {metric}{mark}: {cells}")
        lines.append(f"Plateau check: {self.plateau.get('verdict')}"
                     + (f", last/best gain {self.plateau['last_to_best']:.2f}" if "last_to_best" in self.plateau else ""))
        if self.cliffs:
            for c in self.cliffs:
                recovered = f"recovered by step {c['recovered_step']}" if c["recovered_step"] is not None else "not recovered"
                lines.append(f"Cliff at step {c['step']}: {c['before']:.3f} -> {c['after']:.3f} "
                             f"(lowest {c['lowest']:.3f}), {recovered}")
        else:
            lines.append("Cliffs: none")
        if self.lr.get("checked"):
            cfg = self.lr["config"]
            lines.append(f"LR: peak {self.lr['peak_lr']:.3g} at step {self.lr['peak_step']} (config: {cfg['lr']:.3g}, "
                         f"warmup {cfg['warmup_steps']} of {cfg['total_steps']} steps, {cfg['schedule']}); "
                         f"largest deviation {self.lr['max_error']:.1%} of peak at step {self.lr['worst_step']}")
        elif "peak_step" in self.lr:
            lines.append(f"LR: peak {self.lr['peak_lr']:.3g} at step {self.lr['peak_step']}; {self.lr.get('note', '')}")
        else:
            lines.append(f"LR: {self.lr.get('note', 'not logged')}")
        if "share_above_2x_running_median" in self.loss:
            m = self.loss["mixture"]
            lines.append(f"Loss: median {self.loss['median']:.3f}; above 2x running median "
                         f"{self.loss['share_above_2x_running_median']:.1%} (2x global median "
                         f"{self.loss['share_above_2x_global_median']:.1%}); bimodal {self.loss['bimodal']} "
                         f"(BIC one {m['bic_one']:.0f} vs two {m['bic_two']:.0f}, separation {m['separation']:.1f})")
        else:
            lines.append(f"Loss: {self.loss.get('note', '-')}")
        for e in self.epochs:
            lines.append(f"Epoch {e['epoch']} boundary at step {e['step']}: loss {e['loss_before']:.3f} -> "
                         f"{e['loss_after']:.3f} ({e['delta']:+.3f})")
        for note in self.notes:
            lines.append(f"Note: {note}")
        return "\n".join(lines)


    def _learning_line(self) -> str:
        info = self.learning
        if "loss_end" not in info:
            return f"Learning: {info.get('note', 'no loss logged')}"
        line = f"Learning: loss {info['loss_start']:.3f} -> {info['loss_end']:.3f} ({-info['loss_drop']:+.1%})"
        if "ln_vocab" in info:
            line += f"; ln(vocabulary {info['vocab_size']}) = {info['ln_vocab']:.3f}"
        if "acc_end" in info:
            line += f"; {info['acc_key']} {info['acc_start']:.1%} -> {info['acc_end']:.1%}"
        return line


def check_cliffs(records: Sequence[dict], window: int, drop: float) -> tuple[list[dict], list[Finding]]:
    """Sudden accuracy drops (`find_cliffs`), each a finding saying whether it recovered."""
    acc_key = accuracy_key(records)
    if not acc_key:
        return [], []
    cliffs = find_cliffs(records, acc_key, window, drop)
    findings = []
    for c in cliffs:
        recovered = (f"recovered by step {c['recovered_step']}" if c["recovered_step"] is not None
                     else "never recovered")
        findings.append(Finding(
            "cliff",
            f"Instability cliff at step {c['step']}: {acc_key} fell from {c['before']:.3f} to {c['after']:.3f} "
            f"(lowest {c['lowest']:.3f}), {recovered}.",
            [c["step"]] + ([c["recovered_step"]] if c["recovered_step"] is not None else []),
        ))
    return cliffs, findings


def diagnose(
    run,
    config: RunConfig | None = None,
    window: int | None = None,
    plateau_ratio: float = 0.1,
    slowing_ratio: float = 0.25,
    cliff_window: int = 20,
    cliff_drop: float = 0.08,
    records: list[dict] | None = None,
) -> Diagnosis:
    """Diagnose a run: `run` is a run directory or a train_log.jsonl path (or a
    label when `records` are given). `config` overrides the run's saved config."""
    notes = []
    records = read_log(run) if records is None else Log(records)
    if not records:
        raise ValueError(f"{run}: the training log has no records")
    if config is None:
        try:
            config = read_run_config(run)
        except (OSError, ConfigError) as exc:
            notes.append(f"config unreadable: {exc}")
    schedule = lr_schedule(config, records)
    if config is not None and schedule is None:
        notes.append("the config has no train.max_steps and the log no epoch boundary to estimate the run's "
                     "length from; LR schedule not checked")

    learning, findings = check_learning(records, store_vocab_size(config),
                                        warm_start=bool(config is not None and config.model.init_from))
    metric = primary_metric(records)
    plateau, improvement = {"verdict": "unknown"}, {}
    if metric is None:
        notes.append("no metric with enough points for an improvement verdict")
    else:
        plateau, found = check_plateau(records, metric, window, plateau_ratio, slowing_ratio)
        findings += found
        others = [metric, "loss", accuracy_key(records), "top4_acc", "top8_acc", *TAU_KEYS]
        others += ddtree_keys_by_budget(records) + list(SELECTOR_KEYS)
        for key in dict.fromkeys(k for k in others if k):
            steps, values = series(records, key)
            if len(steps) >= 3:
                rows = improvement_windows(steps, values, plateau["window"], higher_is_better=key != "loss")
                if rows:
                    improvement[key] = rows

    cliffs, found = check_cliffs(records, cliff_window, cliff_drop)
    findings += found
    lr, found = check_lr(records, schedule)
    findings += found
    loss, found = check_loss_distribution(records)
    findings += found
    epochs, found = check_epochs(records)
    findings += found
    return Diagnosis(str(run), [records[0]["step"], records[-1]["step"]], len(records), findings, plateau,
                     improvement, cliffs, lr, loss, epochs, notes, learning)
