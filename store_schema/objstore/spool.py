"""The local directory where a writer builds a shard before uploading it to object storage.

A worker writes each shard here exactly as for a directory store, uploads it
(`objstore.commit.upload_shard`), and deletes it. The space it takes is bounded:

- Every shard being built holds a *reservation*: its directory is named
  ``NAME~HOST~PID~RANDOM~BYTES``, BYTES being an upper bound on what the shard takes
  (`layout.shard_bytes_bound`). A new reservation is made under an flock on
  ``SPOOL/.spool.lock`` only when the reservations already there plus its own fit in
  the spool's limit and the filesystem has that much free; otherwise the writer
  **waits** (a log line every `WAIT_LOG_SECONDS`) until uploads free space. So the
  workers of one node sharing one spool never hold more than the limit together,
  and a full local disk delays a shard instead of failing the job.
- A reservation whose process is gone (same host, pid no longer running: a worker
  SIGKILLed mid-upload) is deleted by the next writer that looks.
- A disk that fills anyway while a shard is written (another program took the space)
  frees the partial shard, waits and writes it again."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..runtime.host import free_bytes, is_disk_full
from ..runtime.units import human_bytes

SEPARATOR = "~"
LOCK_NAME = ".spool.lock"
POLL_SECONDS = 0.5
WAIT_LOG_SECONDS = 30.0


class SpoolTooSmall(ValueError):
    """A shard that could never fit in the spool's limit."""


class Spool:
    """A local directory bounded to `limit` bytes (None: only by its filesystem's free
    space), shared by every writer of the node that names it."""

    def __init__(self, path=None, limit: int | None = None, log: Callable[[str], None] | None = None):
        self.path = Path(path) if path is not None else Path(tempfile.gettempdir()) / "dflash-spool"
        self.limit = limit
        self.log = log or (lambda line: None)
        self.waited_seconds = 0.0  # total time writers of this object waited for room
        self._waits: dict[str, float] = {}  # shard -> seconds it waited, until `wait_of` takes it
        self._waits_lock = threading.Lock()

    @contextmanager
    def shard_dir(self, name: str, need: int, write: Callable[[Path], object]) -> Iterator[tuple[Path, object]]:
        """A fresh directory for shard `name` holding a reservation of `need` bytes,
        filled by `write(dir) -> summary`; yields (dir, summary) and deletes it after.
        The seconds it waited for room are `wait_of(name)` from the yield on."""
        if self.limit is not None and need > self.limit:
            raise SpoolTooSmall(too_small_message(self.path, self.limit, need))
        waited = 0.0
        while True:
            local, seconds = self._reserve(name, need)
            waited += seconds
            try:
                summary = write(local)
            except OSError as error:
                shutil.rmtree(local, ignore_errors=True)
                if not is_disk_full(error):
                    raise
                waited += self._wait(
                    f"{self.path}'s disk filled while shard {name} was written "
                    f"({error.strerror}); waiting for space, then writing it again"
                )
                continue
            break
        with self._waits_lock:
            self.waited_seconds += waited
            self._waits[name] = waited
        try:
            yield local, summary
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def wait_of(self, name: str) -> float:
        """Seconds shard `name` waited for room in this spool, once (then forgotten)."""
        with self._waits_lock:
            return self._waits.pop(name, 0.0)

    def _reserve(self, name: str, need: int) -> tuple[Path, float]:
        """Wait until `need` bytes fit, then make the reservation's directory; (it, seconds waited)."""
        self.path.mkdir(parents=True, exist_ok=True)
        began, last_log = time.monotonic(), None
        while True:
            with self._locked():
                held = self._held()
                free = free_bytes(self.path)
                fits = need <= free and (self.limit is None or held + need <= self.limit)
                if fits:
                    local = self.path / SEPARATOR.join(
                        (name, socket.gethostname(), str(os.getpid()), uuid.uuid4().hex[:8], str(need))
                    )
                    local.mkdir()
                    break
            now = time.monotonic()
            if last_log is None or now - last_log >= WAIT_LOG_SECONDS:
                bound = f"{human_bytes(held)} of its {human_bytes(self.limit)} held, " if self.limit else ""
                self.log(
                    f"spool {self.path} full ({bound}{human_bytes(free)} free on its disk); shard {name} "
                    f"needs up to {human_bytes(need)}: waiting for uploads to free space"
                )
                last_log = now
            time.sleep(POLL_SECONDS)
        return local, time.monotonic() - began

    def _wait(self, why: str) -> float:
        self.log(why)
        began = time.monotonic()
        time.sleep(POLL_SECONDS)
        return time.monotonic() - began

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _held(self) -> int:
        """Bytes reserved by live writers; a dead local writer's reservation is deleted."""
        held, host = 0, socket.gethostname()
        for entry in self.path.iterdir():
            parts = entry.name.split(SEPARATOR)
            if len(parts) != 5 or not parts[4].isdigit():
                continue  # not a reservation (the lock file, something else's)
            if parts[1] == host and parts[2].isdigit() and not _running(int(parts[2])):
                shutil.rmtree(entry, ignore_errors=True)
                continue
            held += int(parts[4])
        return held


def too_small_message(path, limit: int, need: int) -> str:
    return (
        f"--spool-size {human_bytes(limit)} cannot hold one shard: {path} needs up to {human_bytes(need)} "
        "for the largest; raise --spool-size or plan smaller shards (--shard-tokens)"
    )


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
