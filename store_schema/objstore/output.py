"""`job_output.DirectoryOutput`'s calls for a store on object storage: leftovers are
attempts no marker names (`repair.remove_dead_attempts`), nothing is ever set aside
(a shard without its marker is simply not committed), fences are create-only keys."""

from __future__ import annotations

from .. import layout
from ..commit.lock import Attempt
from .bucket import Bucket
from .commit import BucketFence
from .keys import attempt_prefix, shard_marker
from .reader import BucketStore
from .repair import remove_dead_attempts


class BucketOutput:
    def __init__(self, url):
        self.bucket = Bucket(url)
        self.where = str(url)
        self.local_path = None  # no free-space figure: the workers' spools are bounded instead

    def remove_leftovers(self) -> list[str]:
        """Attempts no reader can ever see (a dead writer's, a lost race's), deleted;
        only the job holding the lease calls this. Nothing before the store's root exists."""
        if not self.bucket.exists(layout.ZARR_METADATA):
            return []
        return remove_dead_attempts(BucketStore(self.bucket.url))

    def remove_attempt(self, shard: str, attempt: Attempt) -> None:
        """A revoked attempt's objects (a writer killed mid-upload leaves some)."""
        self.bucket.delete_many(self.bucket.list(attempt_prefix(shard, attempt.token)))

    def set_aside(self, pending: list[str]) -> list[str]:
        return []

    def discard_set_aside(self) -> int:
        return 0

    def is_committed(self, name: str) -> bool:
        return self.bucket.exists(shard_marker(name))

    def uncommitted(self, names: list[str]) -> list[str]:
        """Those of `names` without a marker, in order: one listing of the markers, not a
        request per shard."""
        marked = set(BucketStore(self.bucket.url).shard_entries())
        return [name for name in names if name not in marked]

    def fence(self, run: str) -> BucketFence:
        return BucketFence(self.bucket, run).open()
