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

from store_schema.root import read_root
from train.config import CONFIG_FILE, RunConfig
from train.config_error import ConfigError
from train.config_loading import load_config
from train.diagnose.checks import (
    Finding,
    check_learning,
    check_plateau,
    find_cliffs,
    improvement_windows,
    primary_metric,
)
from train.diagnose.distribution import check_epochs, check_loss_distribution
from train.diagnose.lr import check_lr, lr_schedule
from train.fitting.runlog import TAU_KEYS, Log, accuracy_key, ddtree_keys_by_budget, read_log, series

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
                head, parts = (
                    (
                        f"Too short to judge improvement ({self.records} records, steps {self.steps[0]}-"
                        f"{self.steps[1]}); nothing wrong found: "
                    ),
                    [],
                )
            elif state == "schedule ending":
                share, since = self.plateau["lr_to_peak"], self.plateau["since_step"]
                head, parts = (
                    "No problems found: ",
                    [
                        f"{metric} gains little from step {since}, where the LR is down to {share:.0%} of its peak: "
                        "the schedule is ending, not a plateau"
                    ],
                )
            elif state == "held-out improving":
                rise = self.plateau["heldout"]
                head, parts = (
                    "No problems found: ",
                    [
                        f"{metric} gains little from step {self.plateau['since_step']}, but {rise['key']} still rose "
                        f"{rise['from']:.3g} -> {rise['to']:.3g} (steps {rise['from_step']}-{rise['to_step']}): "
                        "still improving, not a plateau"
                    ],
                )
            else:
                head, parts = "No problems found: ", [f"{metric} {state}"]
            if self.learning.get("learning"):
                parts.insert(
                    0, f"it learns (loss {self.learning['loss_start']:.3g} -> {self.learning['loss_end']:.3g})"
                )
            parts.append("no cliffs")
            parts.append(
                "LR matches the config"
                if self.lr.get("checked")
                else "LR too short to judge"
                if "too short" in self.lr.get("note", "")
                else "LR not checked (no config)"
            )
            parts.append(
                "loss distribution unimodal" if "mixture" in self.loss else "loss distribution too short to judge"
            )
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
        lines = [
            f"Run {self.run}: steps {self.steps[0]}-{self.steps[1]} ({self.records} records)",
            "",
            "VERDICT: " + self.verdict(),
        ]
        for finding in self.findings:
            lines.append(f"  - {finding.message}")
        lines += ["", "Details", "-------"]
        lines.append(self._learning_line())
        lines.append(f"Improvement per 1K steps (window {self.plateau.get('window', '-')} steps):")
        for metric, windows in self.improvement.items():
            cells = "  ".join(f"{w['start']}-{w['end'] - 1}: {w['gain_per_1k']:+.4f}" for w in windows)
            mark = " (verdict metric)" if metric == self.plateau.get("metric") else ""
            lines.append(f"  {metric}{mark}: {cells}")
        lines.append(
            f"Plateau check: {self.plateau.get('verdict')}"
            + (f", last/best gain {self.plateau['last_to_best']:.2f}" if "last_to_best" in self.plateau else "")
        )
        if self.cliffs:
            for c in self.cliffs:
                recovered = (
                    f"recovered by step {c['recovered_step']}" if c["recovered_step"] is not None else "not recovered"
                )
                lines.append(
                    f"Cliff at step {c['step']}: {c['before']:.3f} -> {c['after']:.3f} "
                    f"(lowest {c['lowest']:.3f}), {recovered}"
                )
        else:
            lines.append("Cliffs: none")
        if self.lr.get("checked"):
            cfg = self.lr["config"]
            lines.append(
                f"LR: peak {self.lr['peak_lr']:.3g} at step {self.lr['peak_step']} (config: {cfg['lr']:.3g}, "
                f"warmup {cfg['warmup_steps']} of {cfg['total_steps']} steps, {cfg['schedule']}); "
                f"largest deviation {self.lr['max_error']:.1%} of peak at step {self.lr['worst_step']}"
            )
        elif "peak_step" in self.lr:
            lines.append(f"LR: peak {self.lr['peak_lr']:.3g} at step {self.lr['peak_step']}; {self.lr.get('note', '')}")
        else:
            lines.append(f"LR: {self.lr.get('note', 'not logged')}")
        if "share_above_2x_running_median" in self.loss:
            m = self.loss["mixture"]
            lines.append(
                f"Loss: median {self.loss['median']:.3f}; above 2x running median "
                f"{self.loss['share_above_2x_running_median']:.1%} (2x global median "
                f"{self.loss['share_above_2x_global_median']:.1%}); bimodal {self.loss['bimodal']} "
                f"(BIC one {m['bic_one']:.0f} vs two {m['bic_two']:.0f}, separation {m['separation']:.1f})"
            )
        else:
            lines.append(f"Loss: {self.loss.get('note', '-')}")
        for e in self.epochs:
            lines.append(
                f"Epoch {e['epoch']} boundary at step {e['step']}: loss {e['loss_before']:.3f} -> "
                f"{e['loss_after']:.3f} ({e['delta']:+.3f})"
            )
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
        recovered = f"recovered by step {c['recovered_step']}" if c["recovered_step"] is not None else "never recovered"
        findings.append(
            Finding(
                "cliff",
                f"Instability cliff at step {c['step']}: {acc_key} fell from {c['before']:.3f} to {c['after']:.3f} "
                f"(lowest {c['lowest']:.3f}), {recovered}.",
                [c["step"]] + ([c["recovered_step"]] if c["recovered_step"] is not None else []),
            )
        )
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
        notes.append(
            "the config has no train.max_steps and the log no epoch boundary to estimate the run's "
            "length from; LR schedule not checked"
        )

    learning, findings = check_learning(
        records, store_vocab_size(config), warm_start=bool(config is not None and config.model.init_from)
    )
    metric = primary_metric(records)
    plateau, improvement = {"verdict": "unknown"}, {}
    if metric is None:
        notes.append("no metric with enough points for an improvement verdict")
    else:
        plateau, found = check_plateau(records, metric, window, plateau_ratio, slowing_ratio)
        findings += found
        improvement = improvement_by_metric(records, metric, plateau["window"])

    cliffs, found = check_cliffs(records, cliff_window, cliff_drop)
    findings += found
    lr, found = check_lr(records, schedule)
    findings += found
    loss, found = check_loss_distribution(records)
    findings += found
    epochs, found = check_epochs(records)
    findings += found
    steps = [records[0]["step"], records[-1]["step"]]
    return Diagnosis(
        str(run), steps, len(records), findings, plateau, improvement, cliffs, lr, loss, epochs, notes, learning
    )


def improvement_by_metric(records, metric: str, window: int) -> dict[str, list[dict]]:
    """Improvement per 1K steps in windows of `window` steps, for the primary metric
    and every other the log holds (loss, accuracies, taus, DDTree, the selector's)."""
    others = [metric, "loss", accuracy_key(records), "top4_acc", "top8_acc", *TAU_KEYS]
    others += ddtree_keys_by_budget(records) + list(SELECTOR_KEYS)
    improvement = {}
    for key in dict.fromkeys(k for k in others if k):
        steps, values = series(records, key)
        if len(steps) >= 3:
            rows = improvement_windows(steps, values, window, higher_is_better=key != "loss")
            if rows:
                improvement[key] = rows
    return improvement
