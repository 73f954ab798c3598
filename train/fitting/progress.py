"""What `fit` tells the person watching while it trains: progress lines.

Progress goes through the project's one progress owner (`store_schema.runtime.progress`):
a live bar on a terminal; without one (`ray job logs --follow`, a batch log) a
line every `train.progress_interval` seconds, e.g.

    fit: 120/600 steps (20.0%), 960 samples, 3,210 tokens/s, loss 2.31, acc 0.412, ETA 0:12:34
"""

from __future__ import annotations

from store_schema.runtime.progress import Progress, default_mode

_HEADLINE = {
    "loss": "loss",
    "acc": "acc",
    "eval_tau": "tau",
    "heldout_loss": "heldout_loss",
    "heldout_acc": "heldout_acc",
}


def fit_progress(total_steps: int, start_step: int, interval: float, mode: str | None = None) -> Progress:
    """Steps of a run (starting at `start_step` when resumed)."""
    return Progress("fit", total_steps, "step", mode=mode or default_mode(), interval=interval, initial=start_step)


def headline(record: dict) -> dict[str, str]:
    """The figures of a log record worth a glance: three significant digits, the
    share of time spent waiting for data in percent."""
    shown = {short: f"{record[k]:.3g}" for k, short in _HEADLINE.items() if isinstance(record.get(k), (int, float))}
    if isinstance(record.get("loader_wait_frac"), (int, float)):
        shown["data_wait"] = f"{100 * record['loader_wait_frac']:.0f}%"
    return shown
