"""Committing a directory written aside: the one sequence every shard writer follows
(a store's hidden-state shards, a generated corpus's Parquet shards).

    write_and_commit(root, name, write, make_record, attempt)

`write(staging)` writes the shard's files into a private directory
``root/.staging/NAME.TOKEN.random``; then `write_and_commit` claims the driver's attempt (a revoked one raises
`store_schema.commit.lock.ShardFenced`), writes the commit record listing size + crc32c of
every file, fsyncs, checks, and renames the directory into ``root/shards/NAME``: the
rename is the commit, so readers see a whole shard or none."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .. import layout
from .journal import journal_commit
from .lock import Attempt, claim, discard
from .records import describe_files, fsync_path, fsync_tree, write_record

T = TypeVar("T")


def staging_dir(root, name: str, attempt: Attempt | None = None) -> Path:
    """A fresh private directory under ``root/.staging/`` for one try at shard `name`."""
    prefix = name if attempt is None else f"{name}.{attempt.token}"
    staging = Path(root) / layout.STAGING_DIR / f"{prefix}.{uuid.uuid4().hex[:12]}"
    staging.mkdir(parents=True)
    return staging


def write_and_commit(
    root,
    name: str,
    write: Callable[[Path], T],
    make_record: Callable[[T, dict], dict],
    attempt: Attempt | None = None,
    check: Callable[[Path, dict], None] | None = None,
    journal: bool = False,
) -> dict | None:
    """Write shard `name` of `root` aside with `write(staging) -> summary` and commit
    it. `make_record(summary, files)` gives the commit record's body from the file
    table; `check(staging, record)` may refuse it (raise) right before the rename;
    `journal`: enter the commit in the store's journal (`commit.journal`) after it.
    Returns the record committed (what the writer wrote: its files and sizes), or None
    if another writer committed the shard first. The staging directory is gone
    afterwards, committed or not."""
    root = Path(root)
    staging = staging_dir(root, name, attempt)
    try:
        summary = write(staging)
        if attempt is not None:
            claim(root, name, attempt)  # from here on nobody else touches `staging`
        record = make_record(summary, describe_files(staging))
        write_record(staging / layout.COMMIT_RECORD, record)
        fsync_tree(staging)
        if check is not None:
            check(staging, record)
        try:
            os.rename(staging, layout.shard_dir(root, name))
        except OSError:
            if layout.is_committed(root, name):
                return None  # another writer committed it first
            raise
        fsync_path(root / layout.SHARDS_DIR)
        if journal:
            journal_commit(root, name, record)
        return record
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def remove_staging(path, prefix: str | None = None) -> list[str]:
    """Remove uncommitted `.staging/` leftovers (all, or those named `prefix.*`), each
    renamed away before it is deleted (`store_schema.commit.lock.discard`), so a writer still
    running somewhere can never commit a half-deleted shard. Only for the holder of
    the store's lock."""
    staging = Path(path) / layout.STAGING_DIR
    if not staging.is_dir():
        return []
    entries = sorted(staging.glob(f"{prefix}.*" if prefix else "*"))
    for entry in entries:
        discard(entry)
    return [entry.name for entry in entries if not entry.name.startswith(".trash-")]
