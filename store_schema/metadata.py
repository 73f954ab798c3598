"""A store's metadata, read without torch: the root record (fingerprint, codec), the
commit records of the committed shards, the commit journal, the plan and the
listing. `StoreMetadata` says what every backend answers and derives what follows
from it once; a directory (`directory.metadata`) and a bucket (`objstore.reader`)
each answer it their own way, and neither derives from the other. `reader.StoreReader`
builds the state reads on it; `store_schema info` needs no more than this."""

from __future__ import annotations

from pathlib import Path

from . import layout
from .commit.records import RecordError, ShardCommit
from .dtypes import StoreDtype, store_dtype
from .location import StoreURL
from .plan import Plan
from .projection import Projection
from .root import StoreRoot


class StoreMetadata:
    """What a store holds, without reading a state: its root, commit records, journal,
    plan and listing. The methods that raise NotImplementedError are a backend's to
    answer; the rest is written once here over them."""

    def __init__(self, path: Path | StoreURL, root: StoreRoot):
        self.path = path  # how messages name the store: a directory, or a bucket's URL
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

    # -- what each backend answers (`directory.metadata`, `objstore.reader`) ----------------
    def committed_shards(self) -> list[str]:
        """The committed shards, sorted."""
        raise NotImplementedError

    def is_committed(self, name: str) -> bool:
        raise NotImplementedError

    def commit(self, name: str) -> ShardCommit:
        """The shard's commit record; CorruptShardError if it is missing or damaged."""
        raise NotImplementedError

    def plan(self) -> Plan | None:
        """The committed plan, read once (a full job's holds ~900,000 samples; a
        committed plan never changes); None while the store has none."""
        raise NotImplementedError

    def shard_group(self, name: str):
        """The committed shard `name` as a read-only zarr group (partial reads)."""
        raise NotImplementedError

    def kept_checksum_problems(self, name: str) -> list[tuple[str, str]] | None:
        """What the storage's own checksums say of shard `name`'s files without reading
        them; None: it keeps none (`verify --checksums-only` reads the files)."""
        raise NotImplementedError

    def shard_file(self, name: str, rel: str) -> bytes:
        """The bytes of file `rel` of shard `name`; FileNotFoundError if missing."""
        raise NotImplementedError

    def shard_file_sizes(self, name: str) -> dict[str, int]:
        """{relative path: size} of every file of shard `name` but its commit record (nothing read)."""
        raise NotImplementedError

    def journaled_shards(self) -> set[str] | None:
        """The shards the store's commit journal lists (`commit.journal`); None without one."""
        raise NotImplementedError

    def journal_entry(self, name: str) -> dict:
        """Shard `name`'s journal entry, checked (RecordError when damaged or missing)."""
        raise NotImplementedError

    def shard_entries(self) -> list[str]:
        """Every shard there, committed or not: what `verify` checks."""
        raise NotImplementedError

    def leftovers(self) -> list[str]:
        """Uncommitted writes left behind: never read."""
        raise NotImplementedError

    def has_plan_files(self) -> bool:
        """Whether anything of a plan is there (committed or not)."""
        raise NotImplementedError

    def store_file(self, rel: str) -> bytes:
        """The bytes of a store-level file (`rel` relative to the store); FileNotFoundError if missing."""
        raise NotImplementedError

    def store_record(self, rel: str) -> dict:
        """A store-level record (the root record, the plan's commit record); RecordError if bad."""
        raise NotImplementedError

    def store_file_problems(self, table: dict) -> list[tuple[str, str]]:
        """(path, what is wrong) for each store-level file of `table` ({path relative to the store: entry})."""
        raise NotImplementedError

    def stored_bytes(self) -> int:
        """What the store occupies."""
        raise NotImplementedError

    # -- derived, the same for every backend ---------------------------------------------
    def num_samples(self) -> int:
        return sum(self.commit(n).num_samples for n in self.committed_shards())

    def num_tokens(self) -> int:
        return sum(self.commit(n).num_tokens for n in self.committed_shards())

    def sample_locations(self) -> list[tuple[str, int]]:
        """(shard, index in shard) of every committed sample, in store order."""
        return [(name, i) for name in self.committed_shards() for i in range(self.commit(name).num_samples)]
