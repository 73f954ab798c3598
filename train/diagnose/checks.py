"""The statistics behind `train.diagnose.report`: whether the run learns at all,
improvement per 1K steps in windows and the plateau verdict, instability cliffs (the
loss's distribution and epoch-boundary jumps: `train.diagnose.distribution`). Each
check takes the log's records and returns (details, findings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from train.fitting.runlog import accuracy_key, ddtree_keys, series


@dataclass
class Finding:
    # not_learning | plateau | slowing | no_improvement | cliff | lr_schedule | loss_spikes | bimodal_loss | epoch_jump
    kind: str
    message: str
    steps: list[int] = field(default_factory=list)


# -- does it learn at all ------------------------------------------------------------------------


MIN_LEARNING_POINTS = 20  # logged loss values below which "does it learn" is not judged
LOSS_DROP = 0.05  # a loss that fell by less than this share of its start has not moved
UNIFORM_SHARE = 0.9  # a loss above this share of ln(vocabulary) is no better than a uniform guess
CHANCE_ACC = 0.05  # top-1 accuracy under this at the end of a run drafts nothing (tau ~1)


def check_learning(records, vocab_size: int | None = None, warm_start: bool = False):
    """Does the run learn at all: the loss at the end (median of the last tenth)
    against its start (median of the first twentieth) and against ln of the
    vocabulary (a uniform guess), with the top-1 accuracy at the end at chance
    (a loss can stay high while the argmax is right: a head with flat logits).
    A warm start (`model.init_from`) may begin near its best, so only
    ln(vocabulary) judges its loss."""
    steps, loss = series(records, "loss")
    info: dict = {"vocab_size": vocab_size}
    if len(loss) < MIN_LEARNING_POINTS:
        info["note"] = f"too short to judge ({len(loss)} loss values, {MIN_LEARNING_POINTS} needed)"
        return info, []
    start = float(np.median(loss[: max(3, len(loss) // 20)]))
    end = float(np.median(loss[-max(5, len(loss) // 10) :]))
    info.update(loss_start=start, loss_end=end, loss_drop=(start - end) / start if start > 0 else 0.0)
    stuck = []
    if not warm_start and end > (1 - LOSS_DROP) * start:
        stuck.append(
            f"the loss is {end:.3f} at the end against {start:.3f} at the start "
            f"({-info['loss_drop']:+.1%}: it has not moved)"
        )
    if vocab_size and vocab_size > 1:
        info["ln_vocab"] = math.log(vocab_size)
        if end > UNIFORM_SHARE * info["ln_vocab"]:
            stuck.append(f"it is near ln({vocab_size}) = {info['ln_vocab']:.3f}, a uniform guess over the vocabulary")
    key = accuracy_key(records)
    _, acc = series(records, key) if key else (None, np.array([]))
    chance = True
    if len(acc):
        info.update(
            acc_key=key,
            acc_start=float(np.median(acc[: max(3, len(acc) // 20)])),
            acc_end=float(np.median(acc[-max(5, len(acc) // 10) :])),
        )
        chance = info["acc_end"] < CHANCE_ACC
    info["learning"] = not (stuck and chance)
    if info["learning"]:
        return info, []
    accuracy = (
        f"; {key} is {info['acc_end']:.1%} at the end (from {info['acc_start']:.1%}), at chance" if len(acc) else ""
    )
    message = (
        "Not learning: " + "; ".join(stuck) + accuracy + ". Check the LR (optim.lr, warmup), that the "
        "store's context features are not constant or zero (`python -m store_schema verify --recompute`), "
        "and the loss mask."
    )
    return info, [Finding("not_learning", message, [int(steps[0]), int(steps[-1])])]


# -- trends and cliffs --------------------------------------------------------------------------


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


def improvement_windows(
    steps: np.ndarray, values: np.ndarray, window: int, higher_is_better: bool = True
) -> list[dict]:
    """Gain per 1K steps in successive windows [k*window, (k+1)*window) (slope of a
    least-squares line through the window's points; for loss, the drop). Every
    window lies inside the run: the last one ends at the last logged step, and is
    merged into the one before when shorter than half a window."""
    if not len(steps):
        return []
    first = int(steps[0] // window * window)
    edges = list(range(first, int(steps[-1]) + window, window))
    if len(edges) > 2 and steps[-1] - edges[-2] < window / 2:
        edges.pop(-2)
    edges[-1] = int(steps[-1]) + 1
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (steps >= lo) & (steps < hi)
        slope = _slope_per_1k(steps[inside], values[inside])
        if slope is None:
            continue
        gain = slope if higher_is_better else -slope
        out.append(
            {
                "start": lo,
                "end": hi,
                "points": int(inside.sum()),
                "gain_per_1k": gain,
                "mean": float(values[inside].mean()),
            }
        )
    return out


def hinge_fit(steps: np.ndarray, values: np.ndarray, grid: int = 200) -> int:
    """Step b that best fits `values ~ a + c * min(step, b)` (a rise, then flat)."""
    if len(steps) > 2000:  # bin means: same fit, fewer points
        edges = np.linspace(steps[0], steps[-1], 1001)
        index = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, 999)
        counts = np.bincount(index, minlength=1000)
        keep = counts > 0
        steps = np.bincount(index, steps, 1000)[keep] / counts[keep]
        values = np.bincount(index, values, 1000)[keep] / counts[keep]
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
    order += ["eval_tau", "eval_tau_per_position", "heldout_tau_per_position"]
    order += sorted((k for k, (p, _) in trees.items() if not p), key=lambda k: trees[k][1])
    order += ["tau_per_position", accuracy_key(records) or "acc", "loss"]
    for key in order:
        steps, _ = series(records, key)
        if len(steps) < 12:
            continue
        window = auto_window(steps[0], steps[-1])
        counts = np.bincount(((steps - steps[0]) // window).astype(int))
        if len(counts) >= 3 and counts[:-1].min() >= min_points:
            return key
    return None


SCHEDULE_ENDING = 0.07  # windows that start below this share of the peak LR: the schedule is ending
HELDOUT_RISE = 0.03  # a held-out acceptance that rose by more than this share since the flattening still improves
HELDOUT_KEYS = ("eval_tau", "eval_tau_per_position", "heldout_tau_per_position", "heldout_acc")


def lr_share_at(records, step: int) -> float | None:
    """The logged LR at the first record from `step` on, as a share of the run's
    peak LR (None without an LR in the log)."""
    steps, lrs = series(records, "lr")
    if not len(lrs) or lrs.max() <= 0 or not (steps >= step).any():
        return None
    return float(lrs[steps >= step][0] / lrs.max())


def heldout_rise(records, since: int) -> dict | None:
    """The held-out acceptance from its last evaluation at or before `since` (else
    its first) to its last one, when it rose by more than `HELDOUT_RISE` of its
    level (the training metric may flatten while what is served still improves);
    None otherwise."""
    for key in HELDOUT_KEYS:
        steps, values = series(records, key)
        if len(steps) < 2 or steps[-1] <= since:
            continue
        before = np.nonzero(steps <= since)[0]
        first = int(before[-1]) if len(before) else 0
        start, end = float(values[first]), float(values[-1])
        if end - start > HELDOUT_RISE * abs(start):
            return {"key": key, "from_step": int(steps[first]), "to_step": int(steps[-1]), "from": start, "to": end}
        return None
    return None


def annealed_tail(records, windows: list[dict]) -> tuple[list, int, bool]:
    """Each window's LR share of its peak, how many windows come before the annealed
    tail (LR under `SCHEDULE_ENDING` of its peak; warmup's low LR is no tail), and
    whether that tail is judged apart (at least three windows before it)."""
    shares = [lr_share_at(records, w["start"]) for w in windows]
    kept = len(windows)
    while kept and (share := shares[kept - 1]) is not None and share < SCHEDULE_ENDING:
        kept -= 1
    return shares, kept, kept < len(windows) and kept >= 3


def check_plateau(records, metric: str, window: int | None, plateau_ratio: float, slowing_ratio: float):
    """Plateau / slowing: the last window gains under `plateau_ratio` / `slowing_ratio`
    of the best. Windows that start once the LR has annealed (under
    `SCHEDULE_ENDING` of its peak) are not judged, and neither is a flattening
    while the held-out acceptance still rises."""
    steps, values = series(records, metric)
    window = window or auto_window(steps[0], steps[-1])
    windows = improvement_windows(steps, values, window, higher_is_better=metric != "loss")
    info = {"metric": metric, "window": window, "windows": windows, "verdict": "unknown"}
    if len(windows) < 3:
        info["verdict"] = "too short"
        return info, []
    shares, kept, annealed = annealed_tail(records, windows)
    judged = windows[:kept] if annealed else windows
    gains = [w["gain_per_1k"] for w in judged]
    best_index = int(np.argmax(gains))
    best, last = gains[best_index], gains[-1]
    info.update(
        best_gain_per_1k=best,
        last_gain_per_1k=last,
        best_window=[judged[best_index]["start"], judged[best_index]["end"]],
    )
    last_window = f"steps {judged[-1]['start']}-{judged[-1]['end'] - 1}"
    if best <= 0:
        info["verdict"] = "no improvement"
        message = f"{metric} never improved: the best window gains {best:+.4g} per 1K steps."
        return info, [Finding("no_improvement", message, [judged[0]["start"]])]
    ratio = last / best
    info["last_to_best"] = ratio
    if ratio > slowing_ratio:
        if annealed and windows[-1]["gain_per_1k"] <= slowing_ratio * best:  # faded once the LR was nearly 0
            info.update(verdict="schedule ending", lr_to_peak=shares[kept], since_step=windows[kept]["start"])
        else:
            info["verdict"] = "improving"
        return info, []
    # The plateau starts where the last run of low-gain windows starts; the hinge
    # fit over the data from the best window on places it to the step.
    low = slowing_ratio * best if ratio > plateau_ratio else plateau_ratio * best
    since_window = judged[start_of_low_run(gains, low)]["start"]
    rise = heldout_rise(records, since_window)
    if rise is not None:
        info.update(verdict="held-out improving", since_step=since_window, heldout=rise)
        return info, []
    tail = steps >= judged[best_index]["start"]
    since = hinge_fit(steps[tail], values[tail]) if tail.sum() >= 10 else since_window
    info.update(since_step=since)
    best_text = f"{best:+.4g}/1K at best (steps {judged[best_index]['start']}-{judged[best_index]['end'] - 1})"
    if ratio <= plateau_ratio:
        info["verdict"] = "plateau"
        message = (
            f"Plateau: {metric} gains {last:+.4g} per 1K steps in the last window ({last_window}), "
            f"{max(ratio, 0):.0%} of the {best_text}; flat since about step {since}."
        )
        return info, [Finding("plateau", message, [since, int(judged[-1]["start"])])]
    info["verdict"] = "slowing"
    message = (
        f"Slowing: {metric} gains {last:+.4g} per 1K steps in the last window ({last_window}), "
        f"{ratio:.0%} of the {best_text}."
    )
    return info, [Finding("slowing", message, [since_window])]


def start_of_low_run(gains: list[float], low: float) -> int:
    """The first window of the last run of windows gaining at most `low`."""
    first = len(gains) - 1
    while first > 0 and gains[first - 1] <= low:
        first -= 1
    return first


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
            means_after = (
                csum[window + best :] - csum[best : n - window + 1]
            ) / window  # mean of v[j:j+window], j >= best
            back = [int(j) for j in np.nonzero(means_after >= level - drop / 2)[0] if j > 0]
            recovered = [min(best + back[0] + window // 2, n - 1)] if back else []  # centre of the first window back
            low = float(means_after[: back[0] + 1].min() if back else means_after.min())
            cliffs.append(
                {
                    "step": int(steps[best]),
                    "before": float(level),
                    "after": float(after[best - window]),
                    "lowest": low,
                    "recovered_step": int(steps[recovered[0]]) if recovered else None,
                }
            )
            group = []
        if i is not None:
            group.append(int(i))
    return cliffs
