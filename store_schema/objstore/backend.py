"""A store under an object-store prefix: the bucket backend (`stores.backend` picks it
for an `s3://` / `gs://` URL). Never overwritten in place; a writer builds each shard
in a local spool before its upload."""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import ROOT_RECORD
from ..location import StoreURL
from .bucket import Bucket
from .commit import BucketWriter, commit_bucket_plan, create_bucket_store
from .lease import KeptLease
from .output import BucketOutput
from .reader import BucketStore, read_bucket_plan
from .repair import clean_bucket, repair_bucket
from .spool import Spool


@dataclass(frozen=True)
class BucketBackend:
    location: StoreURL
    overwritable = False  # a prefix is never deleted in place: a new prefix starts over

    def __str__(self) -> str:
        return str(self.location)

    @property
    def address(self) -> str:
        """How workers and reports are told the store: its URL (never a credential)."""
        return str(self.location)

    def open(self) -> BucketStore:
        return BucketStore(self.location)

    def metadata(self) -> BucketStore:
        return self.open()  # a bucket's reader is its metadata too

    def open_existing(self) -> BucketStore | None:
        return self.open() if Bucket(self.location).exists(ROOT_RECORD) else None

    def create(
        self, fingerprint, codec=None, overwrite: bool = False, keep_plan: bool = False, projection=None
    ) -> BucketWriter:
        if projection is not None or fingerprint.projection:
            raise ValueError(
                f"{self}: a projected store is made in a directory for now (copy it to a bucket once written)"
            )
        if overwrite:
            raise ValueError(f"{self}: a store on object storage is never overwritten in place; use a new prefix")
        return create_bucket_store(self.location, fingerprint, codec)  # a bucket's plan is always its own

    def writer(self, spool_dir=None, spool_bytes: int | None = None, log=None) -> BucketWriter:
        """Shards are built in `spool_dir` (the system's temporary directory by default),
        bounded to `spool_bytes`, then uploaded."""
        return BucketWriter(self.location, Spool(spool_dir, spool_bytes, log))

    def read_plan(self):
        return read_bucket_plan(Bucket(self.location))

    def commit_plan(self, plan) -> None:
        commit_bucket_plan(Bucket(self.location), plan)

    def lock(self, job: str, log=None) -> KeptLease:
        return KeptLease(Bucket(self.location), job=job, log=log)  # a lease renewed while the job runs

    def job_output(self) -> BucketOutput:
        return BucketOutput(self.location)

    def repair(self, report):
        return repair_bucket(self.location, report)  # a damaged shard's marker is deleted

    def clean(self, commitless: bool = True) -> tuple[list[str], list[str]]:
        return clean_bucket(self.location), []
