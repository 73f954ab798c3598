"""What `fit` tells the person watching: progress, and what a Ctrl-C kept.

Progress goes through the project's one progress owner (`store_schema.runtime.progress`):
a live bar on a terminal; without one (`ray job logs --follow`, a batch log) a
line every `train.progress_interval` seconds, e.g.

    fit: 120/600 steps (20.0%), 960 samples, 3,210 tokens/s, loss 2.31, acc 0.412, ETA 0:12:34

Ctrl-C: the loop applies an optimizer step whole or not at all (`sigint_deferred`
around the update), so on an interrupt the trainer checkpoints the last completed
step and raises `TrainingInterrupted`; the command prints one line saying how to
resume and exits 130."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from store_schema.runtime.progress import Progress, default_mode

_HEADLINE = {"loss": "loss", "acc": "acc", "eval_tau": "tau", "heldout_loss": "heldout_loss", "heldout_acc": "heldout_acc"}


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


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during `fit`, after the last completed step was checkpointed (or
    `checkpoint` is None: interrupted before a checkpoint could be written)."""

    def __init__(self, step: int, checkpoint: Path | None):
        super().__init__(step, checkpoint)
        self.step, self.checkpoint = step, checkpoint


class DataStopped(Exception):
    """A corrupt shard met mid-run (damaged after the integrity pass): the last
    completed step was checkpointed (`checkpoint`; None if it could not be)."""

    def __init__(self, step: int, checkpoint: Path | None, error: BaseException):
        super().__init__(step, checkpoint, error)
        self.step, self.checkpoint, self.error = step, checkpoint, error


@contextmanager
def sigint_deferred(reraise: bool = True):
    """Hold Ctrl-C until the block is done (then raise KeyboardInterrupt, or drop it
    with `reraise=False`): for work that must not be cut in half. Outside the main
    thread signals cannot be caught, and the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if pressed and reraise:
        raise KeyboardInterrupt
