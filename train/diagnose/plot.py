"""`python -m train diagnose RUN --plot FILE.png`: loss (training and held-out),
accuracy, tau, DDTree acceptance and LR against step, one or more runs overlaid,
titled with each run's name and diagnose's verdict. Sparse series (evaluations
every few hundred steps) get a marker at each point, so a handful of evaluations
reads as points, not as a line that looks measured in between."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from train.fitting.runlog import TAU_KEYS, accuracy_key, ddtree_keys_by_budget, read_log, series


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if len(values) < window or window <= 1:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


SPARSE_POINTS = 60  # a series with at most this many points is drawn with a marker at each


def plot(
    runs: Iterable,
    path,
    labels: Sequence[str] | None = None,
    smooth: int | None = None,
    verdicts: Sequence[str] | None = None,
) -> Path:
    """Draw the runs (see `figure`) and write a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(runs, labels, smooth, verdicts).savefig(str(path), format="png")
    return path


def figure(
    runs: Iterable,
    labels: Sequence[str] | None = None,
    smooth: int | None = None,
    verdicts: Sequence[str] | None = None,
):
    """Loss, accuracy, tau, DDTree acceptance and LR against step for each run (a
    run directory, a train_log.jsonl, or a list of records), overlaid and aligned by
    step: first run solid, the next dashed, dotted, .... The title names each run
    with its verdict (`verdicts`, one per run) when given."""
    runs = list(runs)
    loaded = [list(r) if isinstance(r, (list, tuple)) else read_log(r) for r in runs]
    labels = (
        list(labels)
        if labels
        else [Path(r).name if not isinstance(r, (list, tuple)) else f"run {i + 1}" for i, r in enumerate(runs)]
    )
    styles = ["-", "--", ":", "-."]
    drawing = Figure(figsize=(11, 14), dpi=100)
    FigureCanvasAgg(drawing)
    axes = drawing.subplots(5, 1, sharex=True)
    panels = [
        ("loss (training; held-out)", lambda rs: ["loss", "heldout_loss"]),
        (
            "accuracy",
            lambda rs: [k for k in (accuracy_key(rs), "top4_acc", "top8_acc", "heldout_acc", "eval_top1_acc") if k],
        ),
        ("tau (acceptance length)", lambda rs: list(TAU_KEYS)),
        ("DDTree acceptance", ddtree_keys_by_budget),
        ("learning rate", lambda rs: ["lr"]),
    ]
    for ax, (title, keys_of) in zip(axes, panels):
        drawn = 0
        for run_index, records in enumerate(loaded):
            style = styles[run_index % len(styles)]
            for key_index, key in enumerate(keys_of(records)):
                label = f"{key} [{labels[run_index]}]" if len(loaded) > 1 else key
                drawn += draw_series(ax, records, key, style, f"C{key_index % 10}", label, smooth)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel("step")
    names = [str(r) if not isinstance(r, (list, tuple)) else labels[i] for i, r in enumerate(runs)]
    titles = [f"{name}: {verdict}" for name, verdict in zip(names, verdicts)] if verdicts else [" vs ".join(names)]
    drawing.suptitle("\n".join(_wrap(title) for title in titles), fontsize=10)
    drawing.tight_layout(rect=(0, 0, 1, 0.97 - 0.012 * sum(_wrap(t).count("\n") + 1 for t in titles)))
    return drawing


def draw_series(ax, records, key: str, style: str, color: str, label: str, smooth: int | None) -> int:
    """One logged series on `ax`: raw (faint) and smoothed, or as logged for the LR.
    Returns 1 when drawn, 0 when the log lacks it."""
    steps, values = series(records, key)
    if not len(steps):
        return 0
    window = smooth or max(1, len(values) // 200)
    line = _smooth(values, window) if key != "lr" else values
    every = max(1, len(values) // 3000)  # a few thousand points per line is all a PNG shows
    if window > 1 and key != "lr":
        ax.plot(steps[::every], values[::every], style, color=color, alpha=0.2, linewidth=0.6)
    ax.plot(
        steps[::every],
        line[::every],
        style,
        color=color,
        marker="o" if len(values) <= SPARSE_POINTS else None,
        markersize=3.5,
        linewidth=1.3,
        label=label,
    )
    return 1


def _wrap(text: str, width: int = 130) -> str:
    return "\n".join(textwrap.wrap(text, width))
