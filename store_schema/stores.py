"""A store's backend, decided once per command (zarr's `Store` pattern): `backend(arg)`
is a `DirectoryBackend` (`directory.backend`) for a path, a `BucketBackend`
(`objstore.backend`) for an `s3://` / `gs://` URL, with the same methods. Callers carry
the object; neither implementation imports the other."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from .codecs.encoding import CodecConfig
from .directory.backend import DirectoryBackend
from .fingerprint import Fingerprint
from .location import StoreURL, classify_store


@runtime_checkable
class StoreBackend(Protocol):
    """What every command does to a store, whichever kind it is."""

    @property
    def location(self) -> Path | StoreURL:
        """The directory, or the bucket's URL."""

    @property
    def overwritable(self) -> bool:
        """Whether `--overwrite` may delete the content in place."""

    @property
    def address(self) -> str:
        """How workers and reports are told the store: an absolute path, or the URL."""

    def open(self):
        """The reader (`reader.Store`, or `objstore.reader.BucketStore`)."""

    def metadata(self):
        """What the store holds, without its states (`metadata.StoreMetadata`: no torch for
        a directory; a bucket's reader)."""

    def open_existing(self):
        """The reader of a store whose root exists (a job to resume), else None."""

    def create(
        self,
        fingerprint: Fingerprint,
        codec: CodecConfig | None = None,
        overwrite: bool = False,
        keep_plan: bool = False,
        projection=None,
    ):
        """An empty store (a projected one's `projection.Projection` written beside its root); its writer."""

    def writer(self, spool_dir=None, spool_bytes: int | None = None, log=None):
        """The writer of an existing store."""

    def read_plan(self):
        """The committed plan of a store whose root may not exist yet; None if none."""

    def commit_plan(self, plan) -> None:
        """Commit `plan` before any worker starts, root or not; a different committed plan is refused."""

    def lock(self, job: str, log=None):
        """The one-live-job guard, not yet acquired: `acquire()`, `release(discard_if_unused=...)`."""

    def job_output(self):
        """What a job's driver does to its output: leftovers, set-aside shards, fences, commits."""

    def repair(self, report):
        """Set aside every planned shard `report` (`tools.verify.verify_store`'s) names a problem of."""

    def clean(self, commitless: bool = True) -> tuple[list[str], list[str]]:
        """`verify --clean`: a dead job's leftovers removed; returns (removed, set aside)."""


def backend(arg) -> StoreBackend:
    """The one place a store argument's kind is decided."""
    if isinstance(arg, StoreBackend):
        return arg
    location = classify_store(arg)
    if isinstance(location, StoreURL):
        from .objstore.backend import BucketBackend  # obstore only where a bucket is used

        return BucketBackend(location)
    return DirectoryBackend(location)


def open_store(arg):
    """The reader of a store path or URL."""
    return backend(arg).open()


def create_store(
    path, fingerprint: Fingerprint, codec: CodecConfig | None = None, overwrite: bool = False, keep_plan: bool = False
):
    """An empty store in a directory (`directory.root.create_store_dir`, whose arguments these
    are) or under an object-store URL (never overwritten in place, and its plan is its own)."""
    return backend(path).create(fingerprint, codec, overwrite=overwrite, keep_plan=keep_plan)
