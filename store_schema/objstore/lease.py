"""The job lease of a store on object storage: the bucket's stand-in for `STORE/.lock`.

Taken by creating `lease.json` (If-None-Match: *), renewed by replacing it with
If-Match on its last ETag, and taken over by the same conditional replace once its
`expires` has passed: of two jobs racing for an expired lease one wins. A holder whose
renewal is refused (taken over while it stalled) has lost the lease and must stop.
Correctness never depends on it: commits are decided by create-only markers and fences;
the lease only keeps a second job from doing the same work, and gives `verify --repair`
and `--clean` a store nobody is writing."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from ..commit.lock import StoreLockedError, describe_holder
from .bucket import Bucket
from .keys import LEASE_KEY

DEFAULT_LEASE_SECONDS = 300.0


class LeaseLost(StoreLockedError):
    """This job's lease was taken over (it expired while the job stalled)."""


class StoreLease:
    def __init__(self, bucket: Bucket, job: str = "extract", seconds: float = DEFAULT_LEASE_SECONDS):
        self.bucket, self.job, self.seconds = bucket, job, float(seconds)
        self.holder = uuid.uuid4().hex
        self.e_tag: str | None = None

    def _body(self, expires: float) -> bytes:
        return json.dumps(
            {
                "job": self.job,
                "holder": self.holder,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.time(),
                "expires": expires,
            },
            sort_keys=True,
        ).encode()

    def acquire(self) -> "StoreLease":
        """Take the lease, or a lapsed one over; StoreLockedError naming the live holder."""
        e_tag = self.bucket.create(LEASE_KEY, self._body(time.time() + self.seconds))
        while e_tag is None:
            current = self.bucket.get_versioned(LEASE_KEY)
            if current is None:  # released in between
                e_tag = self.bucket.create(LEASE_KEY, self._body(time.time() + self.seconds))
                continue
            data, held_tag = current
            info = _parse(data)
            if info.get("expires", 0) > time.time():
                raise StoreLockedError(
                    f"{self.bucket.url} is leased by another live job, {describe_holder(data.decode(errors='replace'))}"
                    f", until {time.strftime('%H:%M:%S UTC', time.gmtime(info['expires']))}; "
                    "wait for it to finish or for its lease to lapse"
                )
            e_tag = self.bucket.replace(LEASE_KEY, self._body(time.time() + self.seconds), held_tag)
            if e_tag is None:
                continue  # another job took it over first: look again (it is live now)
        self.e_tag = e_tag
        return self

    def renew(self) -> None:
        """Extend the lease; LeaseLost if another job has taken it over."""
        held = self.e_tag
        e_tag = None if held is None else self.bucket.replace(LEASE_KEY, self._body(time.time() + self.seconds), held)
        if e_tag is None:
            self.e_tag = None
            raise LeaseLost(f"{self.bucket.url}: this job's lease was taken over by another job; stopping")
        self.e_tag = e_tag

    def release(self) -> None:
        """Hand the lease back (expired at once) if it is still ours."""
        if self.e_tag is not None:
            self.bucket.replace(LEASE_KEY, self._body(0.0), self.e_tag)
            self.e_tag = None

    def __enter__(self) -> "StoreLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _parse(data: bytes) -> dict:
    try:
        info = json.loads(data)
        return info if isinstance(info, dict) and isinstance(info.get("expires"), (int, float)) else {}
    except ValueError:
        return {}  # unreadable: treated as lapsed


class KeptLease:
    """A `StoreLease` held for a whole job: renewed in a background thread every third
    of its term. A lost lease is logged (`lost`), not raised: the job's commits stay
    correct without it, and a renewal that fails on a network blip is tried again."""

    def __init__(self, bucket: Bucket, job: str = "extract", seconds: float = DEFAULT_LEASE_SECONDS, log=None):
        self.lease = StoreLease(bucket, job, seconds)
        self.log = log or (lambda line: None)
        self.lost: LeaseLost | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "KeptLease":
        self.lease.acquire()
        self._thread = threading.Thread(target=self._keep, name="store-lease", daemon=True)
        self._thread.start()
        return self

    def _keep(self) -> None:
        while not self._stop.wait(self.lease.seconds / 3):
            try:
                self.lease.renew()
            except LeaseLost as error:
                self.lost = error
                self.log(f"warning: {error} (commits stay fenced: nothing this job commits is lost or doubled)")
                return
            except Exception as error:
                self.log(f"warning: renewing the lease on {self.lease.bucket.url} failed ({error}); trying again")

    def release(self, discard_if_unused: bool = False) -> None:
        """Stop renewing and hand the lease back (`discard_if_unused`: a directory lock's
        option; a bucket keeps nothing for a lease)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None:
            self.lease.release()
