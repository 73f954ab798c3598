"""Training diagnostics over a run's `train_log.jsonl`: is the run still improving,
did it fall off a cliff, does the learning rate follow the config, is the loss
distribution healthy, what happens at epoch boundaries. Plus plots.

These are the analyses that found the seeds' plateau, made a product:

- improvement per 1K steps in successive step windows (least-squares slope of the
  metric inside each window), and a plateau verdict: the last window gains less
  than `plateau_ratio` of the best window (or nothing at all); the plateau's
  start is located with a hinge fit (rise, then flat);
- instability cliffs: the mean accuracy over the `cliff_window` records after a
  step is more than `cliff_drop` below the mean over the records before it;
- the LR schedule against the run's config: the warmup peak at the configured
  step with the configured value, and every logged LR on the configured curve
  (linear warmup, then cosine / linear / constant);
- the loss distribution: the share of steps above twice the running median, and a
  bimodality flag (a two-Gaussian mixture on log(loss / running median) that
  wins by BIC with well separated, non-negligible components);
- loss deltas at epoch boundaries (mean over the records just before and after).

`diagnose(run)` returns a `Diagnosis`; `render()` gives a plain-language verdict
first and the details after; `plot(runs, path)` draws loss, accuracy, tau, DDTree
and LR against step, overlaying runs aligned by step.

Log records are dicts with at least `step`; the other keys are used when present:
`loss`, `acc` (or `top1_acc`), `top4_acc`, `top8_acc`, `tau`, `lr`, `epoch`, and
held-out evaluation keys: `eval_tau`, `eval_ddtree_<budget>` (as written by
`train.evaluate.log_fields` / `AcceptanceEval`), `heldout_tau`, `heldout_acc`
(the trainer's held-out pass); `heldout_ddtree_<budget>` is read too. Records that share a step are merged (a held-out
evaluation may be logged on its own line).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

LOG_NAME = "train_log.jsonl"
CONFIG_NAMES = ("config.json", "config.yaml", "config.yml", "run_config.json", "run_config.yaml", "train_config.json")
_DDTREE_KEY = re.compile(r"^(?:(heldout|eval)_)?ddtree\D*?(\d+)$")


# -- reading -----------------------------------------------------------------------------


def log_path(run) -> Path:
    """`run` is a run directory (holding train_log.jsonl) or the log file itself."""
    path = Path(run)
    if path.is_dir():
        path = path / LOG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    return path


def read_log(run) -> list[dict]:
    """Records of a train_log.jsonl, merged by step and sorted by step. Blank and
    unreadable lines are skipped (a crash can leave a torn last line)."""
    by_step: dict[int, dict] = {}
    for line in log_path(run).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            continue
        step = int(record["step"])
        by_step.setdefault(step, {}).update(record)
        by_step[step]["step"] = step
    return Log(by_step[s] for s in sorted(by_step))


class Log(list):
    """Records of one run (a list) that remembers the series already extracted."""

    def __init__(self, records=()):
        super().__init__(records)
        self.cache: dict = {}


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a scalar key, skipping records without a finite value."""
    cache = getattr(records, "cache", None)
    if cache is not None and key in cache:
        return cache[key]
    out = _series(records, key)
    if cache is not None:
        cache[key] = out
    return out


def _series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(record["step"])
        values.append(float(value))
    return np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)


def ddtree_keys(records: Sequence[dict]) -> dict[str, tuple[str, int]]:
    """{key: (prefix, budget)} of the DDTree acceptance keys present in the log."""
    found = {}
    for record in records:
        for key in record:
            match = _DDTREE_KEY.match(key)
            if match and key not in found:
                found[key] = (match.group(1) or "", int(match.group(2)))
    return found


def accuracy_key(records: Sequence[dict]) -> str | None:
    for key in ("acc", "top1_acc", "accuracy", "top1"):
        if len(series(records, key)[0]):
            return key
    return None


# -- the run's config ----------------------------------------------------------------------


@dataclass
class ScheduleConfig:
    """What the LR check needs, normalised from whatever the config file says."""

    lr: float
    warmup_steps: int
    total_steps: int
    schedule: str = "cosine"
    min_lr: float = 0.0
    source: str = ""
    estimated: list[str] = field(default_factory=list)  # fields inferred rather than read

    def expected(self, step: float) -> float:
        """LR at `step`: linear warmup 0 -> lr over warmup_steps, then the schedule
        down to min_lr at total_steps."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.schedule in ("constant", "none"):
            return self.lr
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        if self.schedule == "linear":
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


    def expected_array(self, steps: np.ndarray) -> np.ndarray:
        """`expected` over an array of steps."""
        steps = np.asarray(steps, dtype=np.float64)
        warm = self.lr * steps / self.warmup_steps if self.warmup_steps > 0 else np.full_like(steps, self.lr)
        if self.schedule in ("constant", "none"):
            after = np.full_like(steps, self.lr)
        else:
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = np.clip((steps - self.warmup_steps) / span, 0.0, 1.0)
            shape = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + np.cos(np.pi * progress))
            after = self.min_lr + (self.lr - self.min_lr) * shape
        return np.where(steps < self.warmup_steps, warm, after)


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            for k, v in _flatten(value, f"{prefix}{key}.").items():
                flat.setdefault(k, v)
            for k, v in value.items():  # nested keys are also found by their bare name
                if not isinstance(v, dict):
                    flat.setdefault(k, v)
        else:
            flat[f"{prefix}{key}"] = value
            flat.setdefault(key, value)
    return flat


def _first(flat: dict, names: Sequence[str]):
    for name in names:
        if flat.get(name) is not None:
            return flat[name]
    return None


def read_run_config(run) -> tuple[dict | None, str]:
    """The run's saved config as a dict and where it came from; (None, "") if none.
    `run` may be a run directory, a config file, or a dict already."""
    if isinstance(run, dict):
        return run, "dict"
    path = Path(run)
    candidates = [path] if path.is_file() and path.suffix in (".json", ".yaml", ".yml") else []
    if path.is_file() and path.name == LOG_NAME:
        path = path.parent
    if path.is_dir():
        candidates += [path / name for name in CONFIG_NAMES]
    for candidate in candidates:
        if candidate.is_file():
            text = candidate.read_text()
            if candidate.suffix == ".json":
                return json.loads(text), str(candidate)
            import yaml

            return yaml.safe_load(text), str(candidate)
    return None, ""


def schedule_config(config: dict | None, records: Sequence[dict] = (), source: str = "") -> ScheduleConfig | None:
    """Normalise a config dict (flat or nested; trainer's config.json/yaml, or a
    hand-written {lr, warmup, max_steps, schedule}) into a ScheduleConfig.

    Recognised: lr | learning_rate | peak_lr | max_lr; warmup_steps |
    num_warmup_steps, or warmup_ratio | warmup_frac | warmup_fraction, or warmup
    (< 1: a fraction, else steps); max_steps | total_steps | num_steps |
    num_training_steps | train_steps (else epochs x steps per epoch
    estimated from the log's `epoch`); schedule | lr_schedule | scheduler |
    lr_scheduler (default cosine); min_lr | lr_min | final_lr | eta_min, or
    min_lr_ratio | final_lr_frac x lr. None when lr or the total cannot be found."""
    if not config:
        return None
    flat = _flatten(config)
    estimated = []
    lr = _first(flat, ("lr", "learning_rate", "peak_lr", "max_lr"))
    if lr is None:
        return None
    lr = float(lr)
    total = _first(flat, ("max_steps", "total_steps", "num_steps", "num_training_steps", "train_steps"))
    if total is None:
        epochs = _first(flat, ("epochs", "num_epochs", "num_train_epochs"))
        per_epoch = _steps_per_epoch(records)
        if epochs is None or per_epoch is None:
            return None
        total = round(float(epochs) * per_epoch)
        estimated.append("total_steps")
    total = int(total)
    warmup_steps = _first(flat, ("warmup_steps", "num_warmup_steps"))
    if warmup_steps is None:
        fraction = _first(flat, ("warmup_ratio", "warmup_frac", "warmup_fraction"))
        if fraction is None:
            warmup = _first(flat, ("warmup",))
            if warmup is not None and float(warmup) < 1:
                fraction = warmup
            elif warmup is not None:
                warmup_steps = warmup
        if fraction is not None:
            warmup_steps = round(float(fraction) * total)
    warmup_steps = int(warmup_steps or 0)
    schedule = str(_first(flat, ("schedule", "lr_schedule", "scheduler", "lr_scheduler")) or "cosine").lower()
    schedule = "cosine" if "cos" in schedule else "linear" if "linear" in schedule else schedule
    min_lr = _first(flat, ("min_lr", "lr_min", "final_lr", "eta_min"))
    if min_lr is None:
        ratio = _first(flat, ("min_lr_ratio", "final_lr_frac", "min_lr_frac"))
        min_lr = float(ratio) * lr if ratio is not None else 0.0
    return ScheduleConfig(lr, warmup_steps, total, schedule, float(min_lr), source, estimated)


def _steps_per_epoch(records: Sequence[dict]) -> float | None:
    steps, epochs = series(records, "epoch")
    if not len(steps):
        return None
    if np.any(epochs != np.floor(epochs)):  # fractional epochs: step / epoch
        last = np.nonzero(epochs > 0)[0]
        return float(steps[last[-1]] / epochs[last[-1]]) if len(last) else None
    changes = np.nonzero(np.diff(epochs) > 0)[0]
    return float(steps[changes[0] + 1] - steps[0]) if len(changes) else None


# -- the analyses --------------------------------------------------------------------------


@dataclass
class Finding:
    kind: str  # plateau | slowing | no_improvement | cliff | lr_schedule | loss_spikes | bimodal_loss | epoch_jump
    message: str
    steps: list[int] = field(default_factory=list)


def _slope_per_1k(steps: np.ndarray, values: np.ndarray) -> float | None:
    if len(steps) < 3 or np.ptp(steps) == 0:
        return None
    x = steps - steps.mean()
    return float((x * (values - values.mean())).sum() / (x * x).sum() * 1000.0)


def auto_window(first: float, last: float) -> int:
    """A round window size that cuts [first, last] into about 4 to 8 windows."""
    span = max(last - first, 1)
    for size in (50, 100, 200, 250, 500, 1000, 2000, 2500, 4000, 5000, 10000, 20000, 25000, 50000, 100000):
        if span / size <= 8:
            return size
    return int(math.ceil(span / 8))


def improvement_windows(steps: np.ndarray, values: np.ndarray, window: int, higher_is_better: bool = True) -> list[dict]:
    """Gain per 1K steps in successive windows [k*window, (k+1)*window) (slope of a
    least-squares line through the window's points; for loss, the drop). A last
    window shorter than half a window is merged into the one before."""
    if not len(steps):
        return []
    first = int(steps[0] // window * window)
    edges = list(range(first, int(steps[-1]) + window, window))
    if len(edges) > 2 and steps[-1] - edges[-2] < window / 2:
        edges.pop(-2)
    edges[-1] = max(edges[-1], int(steps[-1]) + 1)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (steps >= lo) & (steps < hi)
        slope = _slope_per_1k(steps[inside], values[inside])
        if slope is None:
            continue
        gain = slope if higher_is_better else -slope
        out.append({"start": lo, "end": hi, "points": int(inside.sum()), "gain_per_1k": gain,
                    "mean": float(values[inside].mean())})
    return out


def hinge_fit(steps: np.ndarray, values: np.ndarray, grid: int = 200) -> int:
    """Step b that best fits `values ~ a + c * min(step, b)` (a rise, then flat)."""
    if len(steps) > 2000:  # bin means: same fit, fewer points
        edges = np.linspace(steps[0], steps[-1], 1001)
        index = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, 999)
        counts = np.bincount(index, minlength=1000)
        keep = counts > 0
        steps = (np.bincount(index, steps, 1000)[keep] / counts[keep])
        values = (np.bincount(index, values, 1000)[keep] / counts[keep])
    best, best_sse = int(steps[-1]), math.inf
    for b in np.linspace(steps[0], steps[-1], grid):
        x = np.minimum(steps, b)
        design = np.stack([np.ones_like(x), x], axis=1)
        coef, *_ = np.linalg.lstsq(design, values, rcond=None)
        sse = float(((design @ coef - values) ** 2).sum())
        if sse < best_sse:
            best, best_sse = int(round(b)), sse
    return best


def primary_metric(records: Sequence[dict], min_points: int = 8) -> str | None:
    """The metric the plateau verdict follows: held-out DDTree acceptance (smallest
    budget), held-out tau, logged DDTree / tau, accuracy, then loss: the first
    with at least `min_points` values in every full window (a slope through a
    handful of sparse evaluations is too noisy to call a plateau on)."""
    trees = ddtree_keys(records)
    order = sorted((k for k, (p, _) in trees.items() if p), key=lambda k: trees[k][1])
    order += ["eval_tau", "heldout_tau"]
    order += sorted((k for k, (p, _) in trees.items() if not p), key=lambda k: trees[k][1])
    order += ["tau", accuracy_key(records) or "acc", "loss"]
    for key in order:
        steps, _ = series(records, key)
        if len(steps) < 12:
            continue
        window = auto_window(steps[0], steps[-1])
        counts = np.bincount(((steps - steps[0]) // window).astype(int))
        if len(counts) >= 3 and counts[:-1].min() >= min_points:
            return key
    return None


def check_plateau(records, metric: str, window: int | None, plateau_ratio: float, slowing_ratio: float):
    steps, values = series(records, metric)
    window = window or auto_window(steps[0], steps[-1])
    windows = improvement_windows(steps, values, window, higher_is_better=metric != "loss")
    info = {"metric": metric, "window": window, "windows": windows, "verdict": "unknown"}
    if len(windows) < 3:
        info["verdict"] = "too short"
        return info, []
    gains = [w["gain_per_1k"] for w in windows]
    best_index = int(np.argmax(gains))
    best, last = gains[best_index], gains[-1]
    info.update(best_gain_per_1k=best, last_gain_per_1k=last, best_window=[windows[best_index]["start"], windows[best_index]["end"]])
    last_window = f"steps {windows[-1]['start']}-{windows[-1]['end'] - 1}"
    if best <= 0:
        info["verdict"] = "no improvement"
        return info, [Finding("no_improvement", f"{metric} never improved: the best window gains {best:+.4g} per 1K steps.",
                              [windows[0]["start"]])]
    ratio = last / best
    info["last_to_best"] = ratio
    if ratio > slowing_ratio:
        info["verdict"] = "improving"
        return info, []
    # The plateau starts where the last run of low-gain windows starts; the hinge
    # fit over the data from the best window on places it to the step.
    low = slowing_ratio * best if ratio > plateau_ratio else plateau_ratio * best
    first_low = len(windows) - 1
    while first_low > 0 and gains[first_low - 1] <= low:
        first_low -= 1
    since_window = windows[first_low]["start"]
    tail = steps >= windows[best_index]["start"]
    since = hinge_fit(steps[tail], values[tail]) if tail.sum() >= 10 else since_window
    info.update(since_step=since)
    best_text = (f"{best:+.4g}/1K at best (steps {windows[best_index]['start']}-{windows[best_index]['end'] - 1})")
    if ratio <= plateau_ratio:
        info["verdict"] = "plateau"
        message = (f"Plateau: {metric} gains {last:+.4g} per 1K steps in the last window ({last_window}), "
                   f"{max(ratio, 0):.0%} of the {best_text}; flat since about step {since}.")
        return info, [Finding("plateau", message, [since, int(windows[-1]["start"])])]
    info["verdict"] = "slowing"
    message = (f"Slowing: {metric} gains {last:+.4g} per 1K steps in the last window ({last_window}), "
               f"{ratio:.0%} of the {best_text}.")
    return info, [Finding("slowing", message, [since_window])]


def find_cliffs(records, metric: str, window: int, drop: float) -> list[dict]:
    """Accuracy cliffs: steps where the mean of the next `window` records is more
    than `drop` below the mean of the previous `window`. Overlapping detections
    are one cliff, reported at the step of the largest drop (the first step of
    the lower window), with the lowest windowed value after it and the step
    where the windowed mean is back within drop/2 of the level before (the
    centre of the first such window; None if it never is)."""
    steps, values = series(records, metric)
    n = len(values)
    if n < 2 * window:
        return []
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(window, n - window + 1)
    before = (csum[idx] - csum[idx - window]) / window
    after = (csum[idx + window] - csum[idx]) / window
    drops = before - after
    flagged = idx[drops > drop]
    cliffs = []
    group: list[int] = []
    for i in list(flagged) + [None]:
        if group and (i is None or i - group[-1] > window):
            best = max(group, key=lambda j: drops[j - window])
            level = before[best - window]
            means_after = (csum[window + best:] - csum[best:n - window + 1]) / window  # mean of v[j:j+window], j >= best
            back = [j for j in np.nonzero(means_after >= level - drop / 2)[0] if j > 0]
            recovered = [min(best + back[0] + window // 2, n - 1)] if back else []  # centre of the first window back
            low = float(means_after[: back[0] + 1].min() if back else means_after.min())
            cliffs.append({
                "step": int(steps[best]),
                "before": float(level),
                "after": float(after[best - window]),
                "lowest": low,
                "recovered_step": int(steps[recovered[0]]) if recovered else None,
            })
            group = []
        if i is not None:
            group.append(int(i))
    return cliffs


def check_lr(records, schedule: ScheduleConfig | None, peak_tolerance: float = 0.02, shape_tolerance: float = 0.05):
    """Compare the logged LR with the configured schedule. Allows one step of
    off-by-one (a logged LR may be the value before or after the optimizer step)."""
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
    info.update(checked=True, config=asdict(schedule))
    findings = []
    interval = float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0
    # Where the logged LR first reaches the configured peak (the max itself may
    # sit a step later when warmup ends between log lines).
    expected_peak = schedule.warmup_steps
    step_tol = max(2.0, interval + 1, 0.02 * schedule.warmup_steps)
    problems = []
    if abs(info["peak_step"] - expected_peak) > step_tol and schedule.schedule != "constant":
        problems.append(f"peaks at step {info['peak_step']}, the config's warmup ends at step {expected_peak}")
    if abs(info["peak_lr"] - schedule.lr) > peak_tolerance * schedule.lr:
        problems.append(f"peaks at {info['peak_lr']:.3g}, the config says {schedule.lr:.3g}")
    expected = np.stack([schedule.expected_array(steps + d) for d in (-1, 0, 1)], axis=1)
    error = np.abs(expected - lrs[:, None]).min(axis=1) / schedule.lr
    worst = int(np.argmax(error))
    info.update(max_error=float(error[worst]), worst_step=int(steps[worst]))
    if error[worst] > shape_tolerance:
        problems.append(
            f"at step {int(steps[worst])} it is {lrs[worst]:.3g} where the configured warmup + {schedule.schedule} gives "
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


def _running_median(values: np.ndarray, block: int) -> np.ndarray:
    """Median of each block of `block` records, repeated over the block."""
    out = np.empty_like(values)
    for start in range(0, len(values), block):
        out[start:start + block] = np.median(values[start:start + block])
    return out


def _gaussian_mixture_bic(x: np.ndarray, iterations: int = 200) -> dict:
    """Fit one and two Gaussians to x (EM) and compare by BIC."""
    n = len(x)
    mu, sd = float(x.mean()), float(x.std()) or 1e-9
    loglik1 = float(np.sum(-0.5 * ((x - mu) / sd) ** 2 - math.log(sd) - 0.5 * math.log(2 * math.pi)))
    bic1 = -2 * loglik1 + 2 * math.log(n)
    lo, hi = np.quantile(x, [0.25, 0.75])
    means = np.array([lo, hi], dtype=np.float64)
    sds = np.array([sd, sd], dtype=np.float64)
    weights = np.array([0.5, 0.5])
    floor = max(sd * 1e-3, 1e-9)
    loglik2 = -math.inf
    for _ in range(iterations):
        dens = weights * np.exp(-0.5 * ((x[:, None] - means) / sds) ** 2) / (sds * math.sqrt(2 * math.pi))
        total = dens.sum(1, keepdims=True) + 1e-300
        resp = dens / total
        previous, loglik2 = loglik2, float(np.log(total).sum())
        if abs(loglik2 - previous) < 1e-7 * abs(loglik2):
            break
        mass = resp.sum(0) + 1e-12
        weights = mass / n
        means = (resp * x[:, None]).sum(0) / mass
        sds = np.maximum(np.sqrt((resp * (x[:, None] - means) ** 2).sum(0) / mass), floor)
    bic2 = -2 * loglik2 + 5 * math.log(n)
    separation = abs(means[0] - means[1]) * math.sqrt(2) / math.sqrt(sds[0] ** 2 + sds[1] ** 2)
    order = np.argsort(means)
    return {"bic_one": bic1, "bic_two": bic2, "means": means[order].tolist(), "sds": sds[order].tolist(),
            "weights": weights[order].tolist(), "separation": float(separation)}


def check_loss_distribution(records, block: int = 200, spike_share: float = 0.01) -> tuple[dict, list[Finding]]:
    steps, loss = series(records, "loss")
    if len(loss) < 50 or np.any(loss <= 0):
        return {"note": "too few (or non-positive) loss values"}, []
    median = _running_median(loss, block)
    ratio = loss / median
    high = ratio > 2.0
    info = {"median": float(np.median(loss)), "share_above_2x_running_median": float(high.mean()),
            "share_above_2x_global_median": float((loss > 2 * np.median(loss)).mean()), "block": block}
    mixture = _gaussian_mixture_bic(np.log(ratio))
    bimodal = (mixture["bic_one"] - mixture["bic_two"] > 10 and mixture["separation"] > 2.0
               and min(mixture["weights"]) >= 0.03)
    info.update(mixture=mixture, bimodal=bool(bimodal))
    findings = []
    high_steps = [int(s) for s in steps[high][:10]]
    if bimodal:
        upper = math.exp(mixture["means"][1])
        findings.append(Finding(
            "bimodal_loss",
            f"Bimodal loss: {mixture['weights'][1]:.1%} of steps sit near {upper:.2f}x the running median, "
            f"the rest near {math.exp(mixture['means'][0]):.2f}x ({info['share_above_2x_running_median']:.1%} "
            "of steps above twice the median). Some batches are systematically different: check what they share.",
            high_steps,
        ))
    elif info["share_above_2x_running_median"] > spike_share:
        findings.append(Finding(
            "loss_spikes",
            f"Loss spikes: {info['share_above_2x_running_median']:.1%} of steps are above twice the running median.",
            high_steps,
        ))
    return info, findings


def _median_se(values: np.ndarray) -> float:
    """Standard error of a median, from the MAD (robust to a second loss mode)."""
    sigma = 1.4826 * float(np.median(np.abs(values - np.median(values))))
    return 1.2533 * sigma / math.sqrt(len(values))


def check_epochs(records, window: int = 50, rel_threshold: float = 0.05, sigmas: float = 4.0):
    """Median loss over the `window` records before and after each epoch boundary
    (where the integer part of `epoch` increases); medians so that a bimodal loss
    does not hide a jump. Flagged when the change is over `rel_threshold` of the
    level and `sigmas` standard errors."""
    epoch_steps, epochs = series(records, "epoch")
    loss_steps, loss = series(records, "loss")
    out, findings = [], []
    if not len(epoch_steps) or not len(loss):
        return out, findings
    whole = np.floor(epochs + 1e-9)
    for i in np.nonzero(np.diff(whole) > 0)[0]:
        boundary = epoch_steps[i + 1]
        before = loss[loss_steps < boundary][-window:]
        after = loss[loss_steps >= boundary][:window]
        if len(before) < 5 or len(after) < 5:
            continue
        level_before, level_after = float(np.median(before)), float(np.median(after))
        delta = level_after - level_before
        se = math.sqrt(_median_se(before) ** 2 + _median_se(after) ** 2)
        entry = {"epoch": int(whole[i + 1]), "step": int(boundary), "loss_before": level_before,
                 "loss_after": level_after, "delta": delta}
        out.append(entry)
        if abs(delta) > rel_threshold * level_before and abs(delta) > sigmas * se:
            why = ("the model does worse on data it has seen: an ordering/distribution shift, or state lost at the boundary"
                   if delta > 0 else "repeated data is easier: the drafter is memorising rather than generalising")
            findings.append(Finding(
                "epoch_jump",
                f"Loss {'rises' if delta > 0 else 'drops'} {delta:+.3f} ({delta / before.mean():+.1%}) at the epoch "
                f"{entry['epoch']} boundary (step {entry['step']}): {entry['loss_before']:.3f} -> "
                f"{entry['loss_after']:.3f}; {why}.",
                [entry["step"]],
            ))
    return out, findings


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

    @property
    def healthy(self) -> bool:
        return not self.findings

    def verdict(self) -> str:
        if not self.findings:
            state = self.plateau.get("verdict", "unknown")
            parts = [f"{self.plateau.get('metric', 'the metric')} {state}" if state != "unknown" else "no metric to judge"]
            parts.append("no cliffs")
            parts.append("LR matches the config" if self.lr.get("checked") else "LR not checked (no config)")
            parts.append("loss distribution unimodal")
            parts.append("no epoch-boundary jumps" if self.epochs else "no epoch boundary logged")
            return "No problems found: " + ", ".join(parts) + "."
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


def diagnose(
    run,
    config: dict | None = None,
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
    source = "argument"
    if config is None and not isinstance(run, (list, tuple)):
        try:
            config, source = read_run_config(run)
        except (OSError, ValueError) as exc:
            notes.append(f"config unreadable: {exc}")
            config = None
    schedule = schedule_config(config, records, source)
    if config is not None and schedule is None:
        notes.append(f"config {source or ''} lacks lr or total steps; LR schedule not checked")

    findings: list[Finding] = []
    metric = primary_metric(records)
    plateau, improvement = {"verdict": "unknown"}, {}
    if metric is None:
        notes.append("no metric with enough points for an improvement verdict")
    else:
        plateau, found = check_plateau(records, metric, window, plateau_ratio, slowing_ratio)
        findings += found
        others = [metric, "loss", accuracy_key(records), "top4_acc", "top8_acc", "tau", "eval_tau", "heldout_tau"]
        others += sorted(ddtree_keys(records), key=lambda k: ddtree_keys(records)[k][::-1])
        for key in dict.fromkeys(k for k in others if k):
            steps, values = series(records, key)
            if len(steps) >= 3:
                rows = improvement_windows(steps, values, plateau["window"], higher_is_better=key != "loss")
                if rows:
                    improvement[key] = rows

    cliffs = []
    acc_key = accuracy_key(records)
    if acc_key:
        cliffs = find_cliffs(records, acc_key, cliff_window, cliff_drop)
        for c in cliffs:
            recovered = (f"recovered by step {c['recovered_step']}" if c["recovered_step"] is not None
                         else "never recovered")
            findings.append(Finding(
                "cliff",
                f"Instability cliff at step {c['step']}: {acc_key} fell from {c['before']:.3f} to {c['after']:.3f} "
                f"(lowest {c['lowest']:.3f}), {recovered}.",
                [c["step"]] + ([c["recovered_step"]] if c["recovered_step"] is not None else []),
            ))

    lr, found = check_lr(records, schedule)
    findings += found
    loss, found = check_loss_distribution(records)
    findings += found
    epochs, found = check_epochs(records)
    findings += found
    return Diagnosis(str(run), [records[0]["step"], records[-1]["step"]], len(records), findings, plateau,
                     improvement, cliffs, lr, loss, epochs, notes)


def compare(records_a: Sequence[dict], records_b: Sequence[dict], points: int = 5, window: int = 50) -> dict:
    """Both runs' metrics at common steps (mean of the `window` records up to each
    step), for the keys both logged: {"steps": [...], metric: {"a": [...], "b": [...]}}."""
    last = min(records_a[-1]["step"], records_b[-1]["step"])
    first = max(records_a[0]["step"], records_b[0]["step"])
    checkpoints = [int(round(s)) for s in np.linspace(first, last, points + 1)[1:]] if last > first else [last]
    keys = ["loss", accuracy_key(records_a), "top4_acc", "top8_acc", "tau", "eval_tau", "heldout_tau"]
    keys += sorted(set(ddtree_keys(records_a)) & set(ddtree_keys(records_b)))
    out: dict = {"steps": checkpoints}
    for key in dict.fromkeys(k for k in keys if k):
        sa, va = series(records_a, key)
        sb, vb = series(records_b, key)
        if not len(sa) or not len(sb):
            continue

        def at(steps, values, s):
            upto = values[steps <= s][-window:]
            return float(upto.mean()) if len(upto) else None

        out[key] = {"a": [at(sa, va, s) for s in checkpoints], "b": [at(sb, vb, s) for s in checkpoints]}
    return out


def render_compare(label_a: str, label_b: str, table: dict) -> str:
    lines = [f"Comparison at common steps (mean of the last records up to each step): A = {label_a}, B = {label_b}",
             f"{'metric':<22}" + "".join(f"{s:>16}" for s in table["steps"])]
    for key, values in table.items():
        if key == "steps":
            continue
        cells = []
        for a, b in zip(values["a"], values["b"]):
            cells.append("-" if a is None or b is None else f"{a:.3f}/{b:.3f}")
        lines.append(f"{key + ' A/B':<22}" + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window <= 1:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def plot(runs: Iterable, path, labels: Sequence[str] | None = None, smooth: int | None = None) -> Path:
    """Draw loss, accuracy, tau, DDTree acceptance and LR against step for each
    run (a run directory, a train_log.jsonl, or a list of records), overlaid and
    aligned by step: first run solid, the next dashed, dotted, .... Writes a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = list(runs)
    loaded = [list(r) if isinstance(r, (list, tuple)) else read_log(r) for r in runs]
    labels = list(labels) if labels else [Path(r).name if not isinstance(r, (list, tuple)) else f"run {i + 1}"
                                          for i, r in enumerate(runs)]
    styles = ["-", "--", ":", "-."]
    figure = Figure(figsize=(11, 14), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(5, 1, sharex=True)
    panels = [
        ("loss", lambda rs: ["loss"]),
        ("accuracy", lambda rs: [k for k in (accuracy_key(rs), "top4_acc", "top8_acc", "heldout_acc",
                                             "eval_top1_acc") if k]),
        ("tau (acceptance length)", lambda rs: ["tau", "heldout_tau", "eval_tau"]),
        ("DDTree acceptance", lambda rs: sorted(ddtree_keys(rs), key=lambda k: ddtree_keys(rs)[k][::-1])),
        ("learning rate", lambda rs: ["lr"]),
    ]
    for ax, (title, keys_of) in zip(axes, panels):
        drawn = 0
        for run_index, records in enumerate(loaded):
            style = styles[run_index % len(styles)]
            for key_index, key in enumerate(keys_of(records)):
                steps, values = series(records, key)
                if not len(steps):
                    continue
                color = f"C{key_index % 10}"
                window = smooth or max(1, len(values) // 200)
                line = _smooth(values, window) if key != "lr" else values
                every = max(1, len(values) // 3000)  # a few thousand points per line is all a PNG shows
                if window > 1 and key != "lr":
                    ax.plot(steps[::every], values[::every], style, color=color, alpha=0.2, linewidth=0.6)
                ax.plot(steps[::every], line[::every], style, color=color,
                        linewidth=1.3, label=f"{key} [{labels[run_index]}]" if len(loaded) > 1 else key)
                drawn += 1
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel("step")
    figure.suptitle(" vs ".join(labels), fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(str(path), format="png")
    return path
