"""A local partial copy of a store: its root, its plan and some of its committed shards.

Training from a store on object storage (or a slow shared filesystem) reads through
such a copy (`train.data.cache` decides which shards it holds). The copy is itself a
valid directory store, readable by `reader.Store` and checked by `verify` (it is
incomplete, not damaged): the root and plan files are copied as they are, and each
shard arrives whole, every file checked against the size and crc32c of the source's
commit record (a bad one is fetched once more, then refused naming the shard and
file), and is committed exactly as a writer commits one: a directory renamed into
`shards/` with its record. Nothing here decides which shards to keep.

    copy = open_local_copy("/cache", source)      # source: reader.Store or BucketStore
    copy_shard(source, "/cache", "shard-000003")  # bytes fetched
    keep_copied_shard(source, "/cache", "shard-000003")  # after a restart: still good?
    drop_copied_shard("/cache", "shard-000003")"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from .. import layout
from ..commit.records import RecordError, check_files, file_mismatch, parse_record, write_record
from ..directory.reader import Store
from ..errors import LocalCopyError
from ..reader import StoreReader
from ..runtime.crc32c import crc32c_bytes
from ..shard_decoder import CorruptShardError

FETCHES = 2  # a file that arrives damaged is fetched once more before the shard is refused


def _root_files(source: StoreReader) -> dict[str, bytes]:
    """The source's root and plan files, each checked against its record: {path: bytes}."""
    files = {layout.ROOT_RECORD: source.store_file(layout.ROOT_RECORD)}
    tables = [("", parse_record(files[layout.ROOT_RECORD], f"{source.path}/{layout.ROOT_RECORD}")["files"])]
    plan_record = f"{layout.PLAN_DIR}/{layout.COMMIT_RECORD}"
    try:
        files[plan_record] = source.store_file(plan_record)
    except FileNotFoundError:
        pass  # a store without a plan: nothing of it to copy
    else:
        tables.append(
            (f"{layout.PLAN_DIR}/", parse_record(files[plan_record], f"{source.path}/{plan_record}")["files"])
        )
    for base, table in tables:
        for rel, entry in table.items():
            data = source.store_file(base + rel)
            what = file_mismatch(entry, len(data), lambda: crc32c_bytes(data))
            if what:
                raise RecordError(
                    f"{source.path}/{base}{rel}: {what}; check the store with "
                    f"`python -m store_schema verify {source.path}`"
                )
            files[base + rel] = data
    return files


def _write_file(path: Path, data) -> None:
    """Write `path` whole or not at all (a unique temporary name, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def open_local_copy(directory, source: StoreReader) -> Store:
    """The local copy of `source` in `directory`, created (root and plan) where there
    is none. A directory holding a copy of another store (other root or plan) is
    refused naming both: its shards would not be `source`'s."""
    directory = Path(directory)
    files = _root_files(source)
    for rel in (layout.ZARR_METADATA, f"{layout.PLAN_DIR}/{layout.COMMIT_RECORD}"):
        path = directory / rel
        if path.is_file() and rel in files and path.read_bytes() != files[rel]:
            raise LocalCopyError(
                f"{directory} holds a copy of another store ({rel} differs from {source.path}'s); "
                "give another directory or empty this one"
            )
    if (directory / layout.ZARR_METADATA).is_file() and layout.ZARR_METADATA not in files:
        raise LocalCopyError(f"{directory}: {source.path}'s root record lists no {layout.ZARR_METADATA}")
    # zarr.json last: a directory with it is a store root, so it comes after what it needs
    for rel in sorted(files, key=lambda rel: rel == layout.ZARR_METADATA):
        if not (directory / rel).is_file():
            _write_file(directory / rel, files[rel])
    return Store(directory)


def _fetch_checked(source: StoreReader, name: str, rel: str, entry) -> bytes:
    what: str | None = "file missing"
    for _ in range(FETCHES):
        try:
            data = source.shard_file(name, rel)
        except FileNotFoundError:
            what = "file missing"
            continue
        what = file_mismatch({"size": entry.size, "crc32c": entry.crc32c}, len(data), lambda: crc32c_bytes(data))
        if what is None:
            return data
    raise CorruptShardError(
        name,
        rel,
        f"{what} in {source.path} (fetched {FETCHES} times); check it with "
        f"`python -m store_schema verify {source.path}`",
    )


def copy_shard(source: StoreReader, directory, name: str) -> int:
    """Copy committed shard `name` of `source` whole into the local copy in
    `directory` (`open_local_copy`), committed there as a writer commits: its files
    and record in a staging directory, renamed into `shards/`. Returns the bytes
    copied; CorruptShardError naming the file that arrived damaged twice."""
    directory = Path(directory)
    commit = source.commit(name)
    staging = directory / layout.STAGING_DIR / f"{name}.{uuid.uuid4().hex[:8]}"
    try:
        for rel, entry in sorted(commit.files.items()):
            data = _fetch_checked(source, name, rel, entry)
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        write_record(staging / layout.COMMIT_RECORD, commit.to_json())
        final = layout.shard_dir(directory, name)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, final)
        except OSError:
            if not layout.is_committed(directory, name):  # not another copier's identical shard: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return commit.disk_bytes


def keep_copied_shard(source: StoreReader, directory, name: str) -> bool:
    """Whether the copy of shard `name` in `directory` is still `source`'s (same
    commit record) and intact (every file's size and crc32c); one that is not is
    dropped. False also where there is no copy."""
    copy = Store(directory)
    if not copy.is_committed(name):
        return False
    try:
        same = copy.commit(name).to_json() == source.commit(name).to_json()
    except CorruptShardError:
        same = False
    if same and not check_files(layout.shard_dir(directory, name), copy.commit(name).file_table):
        return True
    drop_copied_shard(directory, name)
    return False


def drop_copied_shard(directory, name: str) -> None:
    """Remove shard `name` from the copy: it leaves `shards/` in one rename, then is deleted."""
    directory = Path(directory)
    gone = directory / layout.STAGING_DIR / f"{name}.dropped.{uuid.uuid4().hex[:8]}"
    gone.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(layout.shard_dir(directory, name), gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def local_copy_holding(source: StoreReader, directory, names) -> tuple[Store, int]:
    """The local copy of `source` in `directory` holding shards `names`: each reused
    where it is intact and still the source's (a training cache's, say), else
    fetched whole. Returns the copy and how many shards were fetched."""
    open_local_copy(directory, source)
    fetched = 0
    for name in sorted(set(names)):
        if not keep_copied_shard(source, directory, name):
            copy_shard(source, directory, name)
            fetched += 1
    return Store(directory), fetched


def copied_shards(directory) -> list[str]:
    """The committed shards the copy in `directory` holds."""
    return Store(directory).committed_shards()
