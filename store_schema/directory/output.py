"""What a sharded job's driver does to its output, the same calls for a directory and
a bucket (`stores.job_output` chooses): clear a dead job's leftovers, set aside shard
directories without a commit record, fence each attempt, tell a committed shard,
and delete what a finished run replaced. The driver (`extract.jobs.driver`) never
asks which kind it holds."""

from __future__ import annotations

from pathlib import Path

from .. import layout
from ..commit.lock import Attempt, ShardFence
from ..commit.staging import remove_staging
from .repair import discard_set_aside, set_aside, uncommitted_shard_dirs


class DirectoryOutput:
    """A store (or generated corpus) in a directory: `.staging/`, renames, `O_EXCL` fences."""

    def __init__(self, path):
        self.path = Path(path)
        self.where = str(self.path)
        self.local_path: Path | None = self.path  # free space is checked here

    def remove_leftovers(self) -> list[str]:
        """A dead job's (or this run's lost attempts') uncommitted `.staging/` entries, removed."""
        return remove_staging(self.path)

    def remove_attempt(self, shard: str, attempt: Attempt) -> None:
        """What a revoked attempt left in `.staging/`."""
        remove_staging(self.path, f"{shard}.{attempt.token}")

    def set_aside(self, pending: list[str]) -> list[str]:
        """Pending shards' directories in `shards/` without a commit record, moved aside."""
        return set_aside(self.path, sorted(set(uncommitted_shard_dirs(self.path)) & set(pending)))

    def discard_set_aside(self) -> int:
        return discard_set_aside(self.path)

    def is_committed(self, name: str) -> bool:
        return layout.is_committed(self.path, name)

    def uncommitted(self, names: list[str]) -> list[str]:
        """Those of `names` not committed, in order."""
        return [name for name in names if not self.is_committed(name)]

    def fence(self, run: str) -> ShardFence:
        return ShardFence(self.path, run).open()
