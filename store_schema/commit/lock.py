"""Who may write a store, and who may commit a shard.

- One live job per store: an OS file lock (flock) on `STORE/.lock`; the kernel drops
  it when the holder dies, so a crashed job never blocks the next one.
- One committing writer per shard attempt: a `ShardFence`. The driver hands each
  shard out as a numbered attempt of its run; before renaming its shard into place
  a writer *claims* its attempt, and the driver *revokes* an attempt it gave up on
  (its worker died, was cut off, or missed its deadline). Claim and revoke create
  the same file with O_EXCL, so exactly one of them wins: a revoked attempt can
  never commit, whatever its process does after it wakes up, and the driver never
  removes the staging files of an attempt that won its claim. The driver's view is
  authoritative."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import ShardFenced, StoreLockedError
from ..layout import LOCK_FILE, STAGING_DIR

# What flock gives on a filesystem that does not support it: Lustre clients mounted
# without `-o flock` (ENOSYS), NFS without a lock manager (ENOLCK), some FUSE mounts.
_FLOCK_UNSUPPORTED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


def flock_unsupported_message(store: Path, error: OSError) -> str:
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return (
        f"cannot lock {store}: its filesystem does not support flock ({name}: {error.strerror}); on Lustre "
        "mount the client with `-o flock` (cluster-wide locks; `-o localflock` is enough when one node runs "
        "the job), on NFS run the lock daemon (or use NFSv4) -- or put the store on a filesystem with flock"
    )


class StoreLock:
    def __init__(self, store_path, job: str = "extract"):
        self.path = Path(store_path) / LOCK_FILE
        self.job = job
        self._fd: int | None = None
        self._made: list[Path] = []  # what acquire created: the lock file, the store directory (and parents)

    def acquire(self) -> "StoreLock":
        store = self.path.parent
        self._made = [d for d in (store, *store.parents) if not d.exists()]  # removed in this order if unused
        store.mkdir(parents=True, exist_ok=True)
        while True:
            fd, created = _open_lock_file(self.path)
            if created:
                self._made.insert(0, self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = describe_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
                os.close(fd)
                raise StoreLockedError(
                    f"{store} is held by another live job, {holder}; wait for it to finish or stop it first"
                ) from None
            except OSError as error:
                os.close(fd)
                self._remove_made()
                if error.errno in _FLOCK_UNSUPPORTED:
                    raise StoreLockedError(flock_unsupported_message(store, error)) from None
                raise
            if _same_file(fd, self.path):
                break
            # A job that released the lock unlinked the file between our open and our
            # flock: we hold a lock on an orphan inode. Drop it and lock the new file.
            os.close(fd)
        os.ftruncate(fd, 0)
        info = {"job": self.job, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self, discard_if_unused: bool = False) -> None:
        """Unlock. With `discard_if_unused`, a lock file (and store directory) this
        lock created is removed when the store holds nothing else: a refused job
        leaves no trace. Removed while still held, so no second job can lock it."""
        if self._fd is None:
            return
        if discard_if_unused and not any(p.name != LOCK_FILE for p in self.path.parent.iterdir()):
            self._remove_made()
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def _remove_made(self) -> None:
        for path in self._made:
            try:
                path.unlink() if path.name == LOCK_FILE else path.rmdir()
            except OSError:
                pass  # not empty or already gone: then it is not ours to remove
        self._made = []

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def describe_holder(text: str) -> str:
    """The lock file's JSON as a sentence: ```extract run ...` (pid 12, host h, since
    2026-12-01 19:30:00 UTC)``; what it holds verbatim if it is not that JSON."""
    try:
        info = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["since"])))
        return f"`{info['job']}` (pid {info['pid']} on {info['host']}, since {since})"
    except (ValueError, KeyError, TypeError):
        return f"which left {text.strip()!r} in its lock file" if text.strip() else "which left no details"


def _open_lock_file(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        try:
            return os.open(path, os.O_RDWR), False
        except FileNotFoundError:  # unlinked in between: make it
            return _open_lock_file(path)


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


# --------------------------------------------------------------------------- shard attempts


@dataclass(frozen=True)
class Attempt:
    """The driver's numbered try at one shard, within one run of a job."""

    run: str  # the run's id (`ShardFence.run`)
    number: int  # 1, 2, ... per shard

    @property
    def token(self) -> str:
        """Part of the staging directory's name (`STAGING/NAME.TOKEN.random`)."""
        return f"{self.run}-{self.number}"


def fence_dir(store: Path, run: str) -> Path:
    return Path(store) / STAGING_DIR / f"fence-{run}"


def claim(store: Path, shard: str, attempt: Attempt) -> None:
    """The writer's side, right before it commits: take the attempt or raise
    `ShardFenced` (revoked by the driver, or the run's fence is gone)."""
    if not _take(store, shard, attempt, "claimed"):
        raise ShardFenced(f"shard {shard} attempt {attempt.token} was revoked by the driver; not committed")


def _take(store: Path, shard: str, attempt: Attempt, what: str) -> bool:
    path = fence_dir(store, attempt.run) / f"{shard}.{attempt.number}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # never creates the fence directory
    except (FileExistsError, FileNotFoundError):
        return False
    try:
        os.write(fd, f"{what} by pid {os.getpid()} on {socket.gethostname()}\n".encode())
    finally:
        os.close(fd)
    return True


class ShardFence:
    """The driver's side: one per run, under the store's lock."""

    def __init__(self, store, run: str | None = None):
        self.store = Path(store)
        self.run = run or uuid.uuid4().hex[:8]
        self.path = fence_dir(self.store, self.run)

    def open(self) -> "ShardFence":
        self.path.mkdir(parents=True)
        return self

    def attempt(self, number: int) -> Attempt:
        return Attempt(self.run, number)

    def revoke(self, shard: str, attempt: Attempt) -> bool:
        """True: the attempt can never commit (and its staging files may go). False:
        its writer claimed it first and is committing (or has committed)."""
        return _take(self.store, shard, attempt, "revoked")

    def close(self) -> None:
        """End the run: every attempt not yet claimed can never be."""
        discard(self.path)


def discard(path: Path) -> None:
    """Remove a staging entry so that no writer can commit half of it: first renamed
    away in one step (a writer's rename of the same directory either landed before,
    whole, or fails), then deleted."""
    path = Path(path)
    trash = path.with_name(f".trash-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink(missing_ok=True)
