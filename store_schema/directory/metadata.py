"""A directory store's metadata (`metadata.StoreMetadata`, answered from the filesystem):
commit records beside each shard, the journal under `commits/`, uncommitted writes under
`.staging/`. No torch: `store_schema info` opens this alone."""

from __future__ import annotations

import os
from pathlib import Path

import zarr

from .. import layout
from ..commit.journal import entry_key, journaled
from ..commit.records import RecordError, ShardCommit, check_files, file_sizes, on_disk_bytes, read_record
from ..metadata import StoreMetadata
from ..plan import Plan
from ..plan_io import read_committed_plan
from ..root import read_root
from ..shard_decoder import CorruptShardError, read_file


class DirectoryMetadata(StoreMetadata):
    """What a directory store holds, read from its files."""

    def __init__(self, path):
        self.path: Path = Path(path)
        super().__init__(self.path, read_root(self.path))

    def shard_group(self, name: str):
        if not self.is_committed(name):
            raise KeyError(f"{self.path}: no committed shard {name!r}")
        return zarr.open_group(str(layout.shard_dir(self.path, name)), mode="r")

    def committed_shards(self) -> list[str]:
        shards = self.path / layout.SHARDS_DIR
        if not shards.is_dir():
            return []
        with os.scandir(shards) as entries:
            names = [entry.name for entry in entries]
        return sorted(name for name in names if layout.is_committed(self.path, name))

    def is_committed(self, name: str) -> bool:
        return layout.is_committed(self.path, name)

    def commit(self, name: str) -> ShardCommit:
        """The shard's commit record; CorruptShardError if it is missing or damaged."""
        if name not in self._commits:
            try:
                body = read_record(layout.shard_dir(self.path, name) / layout.COMMIT_RECORD)
                self._commits[name] = ShardCommit.from_json(body)
            except RecordError as exc:
                raise CorruptShardError(name, layout.COMMIT_RECORD, str(exc)) from None
        return self._commits[name]

    def plan(self) -> Plan | None:
        """The committed plan, read once (a full job's holds ~900,000 samples; a
        committed plan never changes); None while the store has none."""
        if self._plan is None:
            self._plan = read_committed_plan(self.path)
        return self._plan

    def kept_checksum_problems(self, name: str) -> list[tuple[str, str]] | None:
        """None: a filesystem keeps no checksum of its own (`verify` reads the files)."""
        return None

    def shard_file(self, name: str, rel: str) -> bytes:
        """The bytes of file `rel` of shard `name` (`shard_decoder.read_file`); FileNotFoundError if missing."""
        return read_file(layout.shard_dir(self.path, name) / rel)

    def shard_file_sizes(self, name: str) -> dict[str, int]:
        """{relative path: size} of every file of shard `name` but its commit record (nothing read)."""
        return file_sizes(layout.shard_dir(self.path, name), exclude=(layout.COMMIT_RECORD,))

    def journaled_shards(self) -> set[str] | None:
        """The shards the store's commit journal lists (`commit.journal`); None without one."""
        return journaled(self.path)

    def journal_entry(self, name: str) -> dict:
        """Shard `name`'s journal entry, checked (RecordError when damaged or missing)."""
        return read_record(self.path / entry_key(name))

    def shard_entries(self) -> list[str]:
        """Every shard directory in ``shards/``, committed or not: what `verify` checks."""
        try:
            with os.scandir(self.path / layout.SHARDS_DIR) as entries:  # a stat only where d_type is unknown
                return sorted(entry.name for entry in entries if entry.is_dir())
        except FileNotFoundError:
            return []

    def leftovers(self) -> list[str]:
        """Uncommitted writes left behind (``.staging/`` entries): never read."""
        staging = self.path / layout.STAGING_DIR
        return sorted(p.name for p in staging.glob("*")) if staging.is_dir() else []

    def has_plan_files(self) -> bool:
        """Whether anything of a plan is there (committed or not)."""
        return (self.path / layout.PLAN_DIR).exists()

    def store_file(self, rel: str) -> bytes:
        """The bytes of a store-level file (`rel` relative to the store); FileNotFoundError if missing."""
        return (self.path / rel).read_bytes()

    def store_record(self, rel: str) -> dict:
        """A store-level record (the root record, the plan's commit record); RecordError if bad."""
        return read_record(self.path / rel)

    def store_file_problems(self, table: dict) -> list[tuple[str, str]]:
        """(path, what is wrong) for each store-level file of `table` ({path relative to the store: entry})."""
        return check_files(self.path, table)

    def stored_bytes(self) -> int:
        """What the store occupies: a committed shard by its commit record's sizes (read
        anyway for the counts; no walk of its files), everything else as found on disk."""
        shards = self.path / layout.SHARDS_DIR
        total = sum(
            on_disk_bytes(entry) if entry.is_dir() else entry.stat().st_size
            for entry in self.path.iterdir()
            if entry != shards
        )
        if not shards.is_dir():
            return total
        committed = set(self.committed_shards())
        for entry in os.scandir(shards):
            if entry.name in committed:
                total += self.commit(entry.name).disk_bytes + os.path.getsize(
                    os.path.join(entry.path, layout.COMMIT_RECORD)
                )
            else:
                total += on_disk_bytes(entry.path) if entry.is_dir() else entry.stat().st_size
        return total
