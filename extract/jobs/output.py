"""Claiming a job's output directory: one rule for `run` (a store) and `generate`
(a generated corpus)."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from store_schema.directory.root import store_entries
from store_schema.stores import StoreBackend, backend

from ..corpus import require_corpus
from ..errors import ExtractError


def log_to_stderr(message: str) -> None:
    """A job's log when its caller passes none."""
    print(message, file=sys.stderr, flush=True)


def ready_to_start(config, out: StoreBackend, belongs: Callable[[Path], bool], refusal: str) -> None:
    """What every job checks once its target is known, in this order: the corpus is
    there, a directory output is empty or of its own kind (`refuse_foreign_output`; a
    bucket's root refuses another store itself), then CUDA asked of a machine without
    it is refused."""
    require_corpus(config.corpus)
    if isinstance(out.location, Path):
        refuse_foreign_output(out.location, belongs, refusal)
    config.execution.refuse_missing_cuda()


def refuse_foreign_output(path: Path, belongs: Callable[[Path], bool], refusal: str) -> None:
    """Refuse `path` when it is a file, or a non-empty directory that `belongs` does not
    recognise (`refusal` ends the message: what it is not and what to do)."""
    if path.exists() and not path.is_dir():
        raise ExtractError(f"{path} exists and is not a directory")
    if store_entries(path) and not belongs(path):
        raise ExtractError(f"{path} {refusal}")


@contextmanager
def output_locked(output, log=None) -> Iterator[None]:
    """Hold the output's lock (a directory's flock, a bucket's lease: `StoreBackend.lock`)
    for this job (a second live job is refused); released on the way out, and a job
    that wrote nothing leaves nothing. On a read-only filesystem no job can write, so
    there is no lock to take: the job reads on (a complete store has nothing to do;
    any write it needs fails naming the file)."""
    try:
        lock = backend(output).lock(f"extract {' '.join(sys.argv[1:])}"[:2000], log).acquire()
    except OSError as error:
        if error.errno != errno.EROFS:
            raise
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release(discard_if_unused=True)
