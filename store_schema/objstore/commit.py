"""Committing to a store on object storage: no rename, no lock.

A writer builds a shard on local disk exactly as for a directory store (same arrays,
same bytes), then `upload_shard` sends its files under the attempt's own write-once
prefix (`attempts/NAME/ATTEMPT/`), claims the attempt (a create-only fence key, which
the driver's revoke of the same key excludes), and commits by one create-only PUT of
the shard's marker (`shards/NAME/commit.json`: the commit record, every file's size
and crc32c, and the attempt). The first marker wins; a writer that loses the race, or
whose attempt was revoked, deletes its own objects. A crash before the marker leaves
only an attempt no reader looks at, which `clean_bucket` removes."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

from .. import layout
from ..commit.journal import entry_bytes, entry_key
from ..commit.lock import Attempt, ShardFenced
from ..commit.records import describe_files, parse_record, record_bytes
from ..errors import StoreExistsError
from ..plan import Plan
from ..plan_io import write_plan_group
from ..root import parse_root, write_root
from ..writer import ShardWriter, Upload
from .bucket import Bucket
from .keys import MARKER_ATTEMPT, MARKER_ETAGS, PLAN_RECORD, attempt_prefix, fence_key, shard_marker
from .reader import read_bucket_plan
from .spool import Spool

CLAIMED, REVOKED = "claimed", "revoked"  # what a fence key says
KILL_BEFORE_ENV = "DFLASH_OBJSTORE_KILL_BEFORE"  # fault injection: see `_fault_point`


def attempt_of_token(token: str) -> Attempt:
    """The attempt an `Attempt.token` (RUN-N, as an attempt prefix names it) stands for."""
    run, _, number = token.rpartition("-")
    return Attempt(run, int(number))


def claim(bucket: Bucket, shard: str, attempt: Attempt) -> None:
    """The writer's side, right before its marker: take the attempt or raise `ShardFenced`."""
    if not take_fence(bucket, shard, attempt, CLAIMED):
        raise ShardFenced(f"shard {shard} attempt {attempt.token} was revoked by the driver; not committed")


def take_fence(bucket: Bucket, shard: str, attempt: Attempt, what: str) -> bool:
    """Create the attempt's fence key saying `what` (claimed / revoked); False if it exists."""
    return bucket.create(fence_key(attempt.run, shard, attempt.number), f"{what}\n".encode()) is not None


class BucketFence:
    """The driver's side of the fence (`lock.ShardFence`) for a bucket store."""

    def __init__(self, bucket: Bucket, run: str | None = None):
        self.bucket = bucket
        self.run = run or uuid.uuid4().hex[:8]

    def open(self) -> "BucketFence":
        return self

    def attempt(self, number: int) -> Attempt:
        return Attempt(self.run, number)

    def revoke(self, shard: str, attempt: Attempt) -> bool:
        return take_fence(self.bucket, shard, attempt, REVOKED)

    def close(self) -> None:
        """Nothing to remove: a writer of this run that commits later commits a whole shard or nothing."""


def upload_shard(bucket: Bucket, name: str, local: Path, record: dict, attempt: Attempt) -> bool:
    """Send shard `name`'s files in `local` (listed in `record["files"]`), claim
    `attempt`, then create its marker. True: committed; False: another attempt's
    marker was there first. Either way `local` is left as it was (the caller frees it)."""
    prefix = attempt_prefix(name, attempt.token)
    keys, etags = [], {}
    try:
        for rel in sorted(record["files"]):
            key = f"{prefix}/{rel}"
            etags[rel] = bucket.create(key, (Path(local) / rel).read_bytes())
            if etags[rel] is None:
                raise RuntimeError(
                    f"{bucket.where(key)} exists: attempt {attempt.token} was written before; "
                    "an attempt's prefix is written once"
                )
            keys.append(key)
        _fault_point("claim")
        claim(bucket, name, attempt)
        _fault_point("marker")
        marker = dict(record, **{MARKER_ATTEMPT: attempt.token, MARKER_ETAGS: etags})
        committed = bucket.create(shard_marker(name), record_bytes(marker))
    except BaseException:
        bucket.delete_many(keys)
        raise
    if committed is None:
        bucket.delete_many(keys)  # another attempt committed the shard first
        return False
    bucket.put(entry_key(name), entry_bytes(name, marker))  # the store's journal (commit.journal)
    return True


def _fault_point(point: str) -> None:
    """Fault injection for the fault suite: SIGKILL this process at `point` when
    KILL_BEFORE_ENV names it (`claim`: data sent, not claimed; `marker`: claimed, no marker)."""
    if os.environ.get(KILL_BEFORE_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


class BucketWriter(ShardWriter):
    """The shard writer of a store on object storage: each shard is written into a local
    `spool.Spool` (bounded; a full one waits), uploaded, committed by its marker, and freed."""

    direct_io = False  # the uploader reads the spooled files back at once: from the page cache

    def __init__(self, url, spool: Spool | None = None):
        self.bucket = Bucket(url)
        root = parse_root(self.bucket.get(layout.ZARR_METADATA), url, self.bucket.where(layout.ZARR_METADATA))
        super().__init__(url, root)
        self.spool = spool if spool is not None else Spool()
        self._uploads: dict[str, Upload] = {}
        self._uploads_lock = threading.Lock()

    def projection(self) -> None:
        return None  # a bucket store is never projected (its creation refuses one)

    def write_plan(self, plan: Plan) -> None:
        commit_bucket_plan(self.bucket, plan)
        self._plan = plan

    def plan(self) -> Plan | None:
        if self._plan is None:
            self._plan = read_bucket_plan(self.bucket)
        return self._plan

    def is_committed(self, name: str) -> bool:
        return self.bucket.exists(shard_marker(name))

    def commit_written(
        self, name: str, write, make_record, attempt: Attempt | None, check, need: int = 0
    ) -> dict | None:
        attempt = attempt or Attempt(uuid.uuid4().hex[:8], 1)
        spooled = f"{name}.{attempt.token}"
        with self.spool.shard_dir(spooled, need, write) as (local, summary):
            waited = self.spool.wait_of(spooled)
            record = make_record(summary, describe_files(local))
            if check is not None:
                check(local, record)
            began = time.perf_counter()
            committed = upload_shard(self.bucket, name, local, record, attempt)
            sent = sum(int(entry["size"]) for entry in record["files"].values())
            with self._uploads_lock:
                self._uploads[name] = Upload(sent, time.perf_counter() - began, waited)
            return record if committed else None

    def upload_of(self, name: str) -> Upload:
        """Shard `name`'s upload by this writer, once (then forgotten)."""
        with self._uploads_lock:
            return self._uploads.pop(name, Upload())

    def write_report(self, name: str, report: dict):
        key = f"{layout.REPORTS_DIR}/{name}.json"
        self.bucket.put(key, (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
        return self.bucket.where(key)


def create_bucket_store(url, fingerprint, codec=None, spool: Spool | None = None) -> BucketWriter:
    """Create an empty store under `url` (the same root files a directory store has).
    An existing store with the same root is reopened (a resumed job); another one is
    refused: a bucket store is never overwritten in place, use a new prefix."""
    bucket = Bucket(url)
    with tempfile.TemporaryDirectory(prefix="dflash-root.") as tmp:
        write_root(tmp, fingerprint, codec)
        root = {
            rel: (Path(tmp) / rel).read_bytes()
            for rel in (layout.ZARR_METADATA, f"{layout.SHARDS_DIR}/{layout.ZARR_METADATA}", layout.ROOT_RECORD)
        }
    if bucket.create(layout.ZARR_METADATA, root[layout.ZARR_METADATA]) is None:
        if bucket.get(layout.ZARR_METADATA) != root[layout.ZARR_METADATA]:
            raise StoreExistsError(f"{url} holds another store (other fingerprint or codec); use a new prefix")
    for rel in (f"{layout.SHARDS_DIR}/{layout.ZARR_METADATA}", layout.ROOT_RECORD):
        bucket.put(rel, root[rel])
    return BucketWriter(url, spool)


def commit_bucket_plan(bucket: Bucket, plan: Plan) -> None:
    """Commit `plan` into the bucket store: its files, then `plan/commit.json` created
    last. A committed plan is kept; a different one is refused."""
    existing = bucket.get_versioned(PLAN_RECORD)
    if existing is None:
        with tempfile.TemporaryDirectory(prefix="dflash-plan.") as tmp:
            write_plan_group(Path(tmp), plan)
            files = describe_files(Path(tmp))
            for rel in files:
                bucket.put(f"{layout.PLAN_DIR}/{rel}", (Path(tmp) / rel).read_bytes())
        if bucket.create(PLAN_RECORD, record_bytes({"plan_sha256": plan.digest(), "files": files})) is not None:
            return
        existing = bucket.get_versioned(PLAN_RECORD)
        if existing is None:
            raise OSError(f"{bucket.where(PLAN_RECORD)}: created by another job, then gone; start the job again")
    if parse_record(existing[0], bucket.where(PLAN_RECORD))["plan_sha256"] != plan.digest():
        raise ValueError(
            f"{bucket.url}: the store already holds a different plan (other corpus or settings); use a new store"
        )
