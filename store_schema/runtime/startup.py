"""A process's start: importing what it keeps until it exits, without the cycle collector.

torch and transformers' model code build ~360K Python objects that live as long as the
process. CPython's cycle collector makes full passes over all of them while they load
(six during a `train fit` start) and again while the interpreter exits, and finds nothing
to free. On the 2-core CI machine those passes were ~2.3 s of the ~8.5 s of CPU that
importing the trainer takes, start to exit (benchmarks/RESULTS.md). Every heavy process
of the project (the `train`, `extract` and `store_schema` commands, each Ray worker)
imports through `preload`; a model, built later and kept as long, is loaded under
`collector_paused`."""

from __future__ import annotations

import atexit
import gc
import importlib
from contextlib import contextmanager

_frozen_at_exit = False


@contextmanager
def collector_paused():
    """No cycle collection inside the block (also a decorator); the collector's state
    is restored after it, so blocks nest. Cycles made inside are collected later."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def preload(*modules: str) -> None:
    """Import `modules` (torch, transformers' model code, ...) with the collector paused,
    and have everything still alive frozen as the process exits, so that the exit's
    collections skip it. Safe inside a longer-lived process (a test calling a command's
    `main`): nothing is frozen before the exit, and an import already done is free."""
    global _frozen_at_exit
    with collector_paused():
        for name in modules:
            importlib.import_module(name)
    if not _frozen_at_exit:
        atexit.register(gc.freeze)  # once per process, however many preloads
        _frozen_at_exit = True
