"""One live job per store. An OS file lock (flock) on `STORE/.lock`: the kernel
drops it when the holder dies, so a crashed job never blocks the next one."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .layout import LOCK_FILE


class StoreLockedError(RuntimeError):
    pass


class StoreLock:
    def __init__(self, store_path, job: str = "extract"):
        self.path = Path(store_path) / LOCK_FILE
        self.job = job
        self._fd: int | None = None

    def acquire(self) -> "StoreLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(
                f"{self.path.parent} is held by another live job ({holder}); "
                "wait for it to finish or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        info = {"job": self.job, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
