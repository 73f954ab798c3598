"""How `fit` stops early and what it keeps: Ctrl-C (or SIGTERM) and a shard found corrupt mid-run.

Ctrl-C: the loop applies an optimizer step whole or not at all (`sigint_deferred`
around the update), so on an interrupt the trainer checkpoints the last completed
step and raises `TrainingInterrupted`; the command prints one line saying how to
resume and exits 130. A corrupt shard does the same and raises `DataStopped`."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from store_schema import CorruptShardError


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during `fit`, after the last completed step was checkpointed (or
    `checkpoint` is None: interrupted before a checkpoint could be written)."""

    def __init__(self, step: int, checkpoint: Path | None):
        super().__init__(step, checkpoint)
        self.step, self.checkpoint = step, checkpoint


class DataStopped(Exception):
    """A corrupt shard met mid-run (damaged after the integrity pass): the last
    completed step was checkpointed (`checkpoint`; None if it could not be)."""

    def __init__(self, step: int, checkpoint: Path | None, error: CorruptShardError):
        super().__init__(step, checkpoint, error)
        self.step, self.checkpoint, self.error = step, checkpoint, error


DEFERRED = (signal.SIGINT, signal.SIGTERM)  # SIGTERM is Ctrl-C too (store_schema.runtime.cli)


@contextmanager
def sigint_deferred(reraise: bool = True):
    """Hold Ctrl-C and SIGTERM until the block is done (then raise KeyboardInterrupt, or
    drop them with `reraise=False`): for work that must not be cut in half. Outside the
    main thread signals cannot be caught, and the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    previous = {signum: signal.signal(signum, lambda number, frame: pressed.append(number)) for signum in DEFERRED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.default_int_handler if handler is None else handler)
    if pressed and reraise:
        raise KeyboardInterrupt
