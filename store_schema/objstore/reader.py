"""Reading a store on object storage through the same API as a directory store.

`BucketStore` is a `reader.StoreReader`: the training path (`read_shard`, `iter_shards`)
fetches a committed shard's objects whole and decodes them as it decodes files;
partial reads (`read_window`) go through zarr's `ObjectStore` over the attempt's
prefix. The plan names every shard and a shard's marker is at a fixed key, so
nothing a reader does lists the bucket; `verify` lists, to find what is there
besides (unfinished attempts, objects no marker names)."""

from __future__ import annotations

import zarr
from zarr.storage import ObjectStore

from .. import layout
from ..commit.journal import SUFFIX as JOURNAL_SUFFIX
from ..commit.journal import entry_key
from ..commit.records import RecordError, ShardCommit, file_mismatch, parse_record, size_mismatch
from ..plan import Plan
from ..plan_io import plan_from_group
from ..reader import StoreReader
from ..root import parse_root
from ..runtime.crc32c import crc32c_bytes
from ..shard_decoder import CorruptShardError
from .bucket import Bucket
from .errors import explained
from .keys import ATTEMPTS_DIR, MARKER_ATTEMPT, MARKER_ETAGS, PLAN_RECORD, attempt_of_key, attempt_prefix, shard_marker


def read_bucket_plan(bucket: Bucket) -> Plan | None:
    """The store's plan once `plan/commit.json` exists; None before."""
    if not bucket.exists(PLAN_RECORD):
        return None
    with explained(bucket.url):
        group = zarr.open_group(store=ObjectStore(bucket.store, read_only=True), path=layout.PLAN_DIR, mode="r")
        return plan_from_group(group)


class BucketStore(StoreReader):
    """A store under a bucket prefix: its metadata as the object store answers it (markers,
    attempts, listings), read as torch tensors by `StoreReader`'s shared reads."""

    def __init__(self, url):
        self.bucket = Bucket(url)
        super().__init__(url, parse_root(self._root_bytes(url), url, self.bucket.where(layout.ZARR_METADATA)))
        self._attempts: dict[str, str] = {}
        self._etags: dict[str, dict] = {}

    def _root_bytes(self, url) -> bytes:
        try:
            return self.bucket.get(layout.ZARR_METADATA)
        except FileNotFoundError:
            self.bucket.require_bucket()
            raise FileNotFoundError(f"{url}: not a store (no {layout.ZARR_METADATA} under that prefix)") from None

    # -- committed shards ----------------------------------------------------------------
    def plan(self) -> Plan | None:
        if self._plan is None:
            self._plan = read_bucket_plan(self.bucket)
        return self._plan

    def committed_shards(self) -> list[str]:
        plan = self.plan()
        if plan is None:
            return []
        marked = set(self.shard_entries())  # one listing of the markers, not a request per shard
        return sorted(s.name for s in plan.shards if s.name in marked)

    def is_committed(self, name: str) -> bool:
        return name in self._commits or self.bucket.exists(shard_marker(name))

    def commit(self, name: str) -> ShardCommit:
        if name not in self._commits:
            key = shard_marker(name)
            try:
                body = parse_record(self.bucket.get(key), self.bucket.where(key))
                attempt = body.get(MARKER_ATTEMPT)
                if not isinstance(attempt, str) or not attempt:
                    raise RecordError(f"{self.bucket.where(key)}: the marker names no attempt")
                commit = ShardCommit.from_json(body)
                etags = body.get(MARKER_ETAGS) or {}
                if not isinstance(etags, dict):
                    raise RecordError(f"{self.bucket.where(key)}: the marker's {MARKER_ETAGS} is not a mapping")
            except FileNotFoundError:
                raise CorruptShardError(name, layout.COMMIT_RECORD, "commit marker missing") from None
            except RecordError as exc:
                raise CorruptShardError(name, layout.COMMIT_RECORD, str(exc)) from None
            self._commits[name], self._attempts[name], self._etags[name] = commit, attempt, etags
        return self._commits[name]

    def attempt(self, name: str) -> str:
        """The attempt whose objects the shard's marker names."""
        self.commit(name)
        return self._attempts[name]

    def shard_group(self, name: str):
        if not self.is_committed(name):
            raise KeyError(f"{self.path}: no committed shard {name!r}")
        return zarr.open_group(
            store=ObjectStore(self.bucket.store, read_only=True),
            path=attempt_prefix(name, self.attempt(name)),
            mode="r",
        )

    # -- what `verify` reads ---------------------------------------------------------------
    def kept_checksum_problems(self, name: str) -> list[tuple[str, str]] | None:
        """Each committed file's ETag as the service lists it (the checksum it keeps of
        the object) against the one its upload was answered with, recorded in the
        marker: one LIST, no object read. None where the marker recorded none (shards
        committed before ETags were recorded): those are read instead."""
        commit = self.commit(name)
        recorded = self._etags[name]
        if set(recorded) != set(commit.files):
            return None
        prefix = attempt_prefix(name, self.attempt(name))
        listed = {key[len(prefix) + 1 :]: meta for key, meta in self.bucket.list_tagged(prefix).items()}
        problems = []
        for rel, entry in commit.file_table.items():
            size, etag = listed.get(rel, (None, None))
            what = "file missing" if size is None else size_mismatch(entry, size)
            if not what and etag != recorded[rel]:
                what = f"object replaced after its commit: ETag {etag} != {recorded[rel]} answered at upload"
            if what:
                problems.append((rel, what))
        return problems

    def shard_file(self, name: str, rel: str) -> bytes:
        return self.bucket.get(f"{attempt_prefix(name, self.attempt(name))}/{rel}")

    def journaled_shards(self) -> set[str] | None:
        keys = self.bucket.list(layout.COMMITS_DIR)
        if not keys:
            return None
        prefix = layout.COMMITS_DIR + "/"
        return {key[len(prefix) :].removesuffix(JOURNAL_SUFFIX) for key in keys if key.endswith(JOURNAL_SUFFIX)}

    def journal_entry(self, name: str) -> dict:
        key = entry_key(name)
        try:
            return parse_record(self.bucket.get(key), self.bucket.where(key))
        except FileNotFoundError:
            raise RecordError(f"{self.bucket.where(key)}: commit record missing") from None

    def shard_file_sizes(self, name: str) -> dict[str, int]:
        prefix = attempt_prefix(name, self.attempt(name))
        return {key[len(prefix) + 1 :]: size for key, size in self.bucket.list(prefix).items()}

    def shard_entries(self) -> list[str]:
        """Every shard with a marker (listed: `verify` checks what is there, planned or not)."""
        suffix = "/" + layout.COMMIT_RECORD
        keys = self.bucket.list(layout.SHARDS_DIR)
        return sorted(key.split("/")[1] for key in keys if key.endswith(suffix) and key.count("/") == 2)

    def attempts(self) -> dict[tuple[str, str], list[str]]:
        """{(shard, attempt token): its keys} of every attempt in the bucket."""
        found: dict[tuple[str, str], list[str]] = {}
        for key in self.bucket.list(ATTEMPTS_DIR):
            owner = attempt_of_key(key)
            if owner is not None:
                found.setdefault(owner, []).append(key)
        return found

    def leftovers(self) -> list[str]:
        """Attempts no marker names (unfinished, lost a race, or of a marker `--repair` deleted)."""
        committed = {}
        for name in self.shard_entries():
            try:
                committed[name] = self.attempt(name)
            except CorruptShardError:
                continue
        return [f"{shard}.{token}" for shard, token in sorted(self.attempts()) if committed.get(shard) != token]

    def has_plan_files(self) -> bool:
        return bool(self.bucket.list(layout.PLAN_DIR))

    def store_file(self, rel: str) -> bytes:
        return self.bucket.get(rel)

    def store_record(self, rel: str) -> dict:
        try:
            raw = self.bucket.get(rel)
        except FileNotFoundError:
            raise RecordError(f"{self.bucket.where(rel)}: commit record missing") from None
        return parse_record(raw, self.bucket.where(rel))

    def store_file_problems(self, table: dict) -> list[tuple[str, str]]:
        problems = []
        for rel, entry in table.items():
            try:
                data = self.bucket.get(rel)
            except FileNotFoundError:
                problems.append((rel, "file missing"))
                continue
            what = file_mismatch(entry, len(data), lambda: crc32c_bytes(data))
            if what:
                problems.append((rel, what))
        return problems

    def stored_bytes(self) -> int:
        return sum(self.bucket.list("").values())
