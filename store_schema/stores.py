"""The one door for operations that take a store path or URL: a directory goes to
the POSIX code (`reader`, `writer`, `repair`), a `s3://` / `gs://` URL to
`objstore` (`store_schema.location` tells them apart). Dispatching here, above
both, keeps the bucket code free to build on the directory code without either
importing the other back."""

from __future__ import annotations

from pathlib import Path

from .codecs.encoding import CodecConfig
from .fingerprint import Fingerprint
from .layout import ROOT_RECORD
from .location import StoreURL, classify_store


def open_store(arg):
    """The reader (`reader.Store`, or `objstore.reader.BucketStore`) of a store path or URL."""
    location = classify_store(arg)
    if isinstance(location, StoreURL):
        from .objstore.reader import BucketStore  # obstore only where a bucket is used

        return BucketStore(location)
    from .reader import Store

    return Store(location)


def create_store(path, fingerprint: Fingerprint, codec: CodecConfig | None = None, overwrite: bool = False,
                 keep_plan: bool = False):
    """An empty store in a directory (`writer.create_store_dir`, whose arguments these
    are) or under an object-store URL (`objstore.commit.create_bucket_store`: never
    overwritten in place, and its plan is its own)."""
    location = classify_store(path)
    if isinstance(location, StoreURL):
        if overwrite:
            raise ValueError(f"{path}: a store on object storage is never overwritten in place; use a new prefix")
        from .objstore.commit import create_bucket_store  # obstore only where a bucket is used

        return create_bucket_store(location, fingerprint, codec)
    from .writer import create_store_dir

    return create_store_dir(Path(location), fingerprint, codec, overwrite=overwrite, keep_plan=keep_plan)


def repair_store(store, report):
    """Set aside every planned shard `report` (`verify.verify_store`'s) names a problem
    of (`repair.repair_dir`; a bucket's markers are deleted, `objstore.repair`)."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.repair import repair_bucket

        return repair_bucket(location, report)
    from .tools.repair import repair_dir

    return repair_dir(location, report)


def clean_store(store, commitless: bool = True) -> tuple[list[str], list[str]]:
    """`verify --clean`: a dead job's leftovers removed (`repair.clean_dir`, or
    `objstore.repair.clean_bucket`); returns (removed, set aside)."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.repair import clean_bucket

        return clean_bucket(location), []
    from .tools.repair import clean_dir

    return clean_dir(location, commitless)


def job_output(store):
    """What a job's driver does to its output (`job_output.DirectoryOutput`, or
    `objstore.output.BucketOutput`): leftovers, set-aside shards, fences, commits."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.output import BucketOutput

        return BucketOutput(location)
    from .commit.job_output import DirectoryOutput

    return DirectoryOutput(location)


def lock_store(store, job: str, log=None):
    """The one-live-job guard, not yet acquired: `lock.StoreLock` (flock on `.lock`) for
    a directory, `objstore.lease.KeptLease` (a lease renewed while the job runs) for a
    bucket. Both have `acquire()` and `release(discard_if_unused=...)`."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.bucket import Bucket
        from .objstore.lease import KeptLease

        return KeptLease(Bucket(location), job=job, log=log)
    from .commit.lock import StoreLock

    return StoreLock(location, job=job)


def open_writer(store, spool_dir=None, spool_bytes: int | None = None, log=None):
    """The writer of an existing store: `writer.StoreWriter`, or for a bucket an
    `objstore.commit.BucketWriter` building shards in a local spool (`spool.Spool` in
    `spool_dir`, the system's temporary directory by default, bounded to `spool_bytes`)."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.commit import BucketWriter
        from .objstore.spool import Spool

        return BucketWriter(location, Spool(spool_dir, spool_bytes, log))
    from .writer import StoreWriter

    return StoreWriter(location)


def commit_store_plan(store, plan) -> None:
    """Commit `plan` before any worker starts, root or not (`writer.commit_plan`,
    `objstore.commit.commit_bucket_plan`); a different committed plan is refused."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.bucket import Bucket
        from .objstore.commit import commit_bucket_plan

        return commit_bucket_plan(Bucket(location), plan)
    from .writer import commit_plan

    return commit_plan(location, plan)


def read_store_plan(store):
    """The committed plan of a store whose root may not exist yet; None if none."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.bucket import Bucket
        from .objstore.reader import read_bucket_plan

        return read_bucket_plan(Bucket(location))
    from .plan_io import read_committed_plan

    return read_committed_plan(location) if location.is_dir() else None


def open_existing_store(store):
    """The reader of a store whose root exists (a job to resume), else None."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.bucket import Bucket

        return open_store(location) if Bucket(location).exists(ROOT_RECORD) else None
    return open_store(location) if (location / ROOT_RECORD).is_file() else None
