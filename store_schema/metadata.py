"""A store's metadata, read without torch: the root record (fingerprint, codec), the
commit records of the committed shards, the commit journal, the plan and the
listing. `reader.Store` builds the state reads on it; `store_schema info` needs no
more than this."""

from __future__ import annotations

import os
from pathlib import Path

from . import layout
from .commit.journal import entry_key, journaled
from .commit.records import RecordError, ShardCommit, check_files, file_sizes, on_disk_bytes, read_record
from .dtypes import StoreDtype, store_dtype
from .plan import Plan
from .plan_io import read_committed_plan
from .projection import Projection
from .root import read_root
from .shard_decoder import CorruptShardError, read_file


class StoreMetadata:
    """What a store holds, without reading a state: its root, commit records, journal,
    plan and listing. No torch: `store_schema info` opens this alone; `reader.Store`
    adds the reads."""

    def __init__(self, path):
        self.path = Path(path)
        root = read_root(self.path)
        self.attrs, self.fingerprint, self.codec = root.attrs, root.fingerprint, root.codec
        self.dtype: StoreDtype = store_dtype(self.fingerprint.dtype)
        self._commits: dict[str, ShardCommit] = {}
        self._plan: Plan | None = None
        self._projection: Projection | None = None

    # -- metadata -----------------------------------------------------------------------
    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.fingerprint.layer_ids

    @property
    def hidden_size(self) -> int:
        return self.fingerprint.hidden_size

    def projection(self) -> Projection | None:
        """A projected store's directions (None: stored whole), read once and checked
        against the digest its fingerprint records."""
        recorded = self.fingerprint.projection
        if not recorded:
            return None
        if self._projection is None:
            what = f"{self.path}: {layout.PROJECTION_FILE}"
            try:
                raw = self.store_file(layout.PROJECTION_FILE)
            except FileNotFoundError:
                raise RecordError(f"{what} is missing; the fingerprint says the store is projected") from None
            try:
                projection = Projection.from_bytes(raw, what)
            except (ValueError, KeyError) as exc:
                raise RecordError(f"{what} is unreadable ({exc})") from None
            if projection.digest() != recorded["sha256"]:
                raise RecordError(f"{what} differs from the one the fingerprint records (sha256)")
            self._projection = projection
        return self._projection

    def require_layers(self, layer_ids) -> list[int]:
        layer_ids = list(self.layer_ids if layer_ids is None else layer_ids)
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise KeyError(f"{self.path}: store has no layer(s) {missing}; it holds layers {list(self.layer_ids)}")
        return layer_ids

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

    # -- what `verify` reads; a bucket store (`store_schema.objstore`) answers the same ----
    def kept_checksum_problems(self, name: str) -> list[tuple[str, str]] | None:
        """What the storage's own checksums say of shard `name`'s files without reading
        them; None: it keeps none (a directory: `verify --checksums-only` reads the files)."""
        return None

    def shard_file(self, name: str, rel: str):
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

    def num_samples(self) -> int:
        return sum(self.commit(n).num_samples for n in self.committed_shards())

    def num_tokens(self) -> int:
        return sum(self.commit(n).num_tokens for n in self.committed_shards())

    def sample_locations(self) -> list[tuple[str, int]]:
        """(shard, index in shard) of every committed sample, in store order."""
        return [(name, i) for name in self.committed_shards() for i in range(self.commit(name).num_samples)]
