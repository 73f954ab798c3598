"""The store's own list of what it committed, beside the shards themselves.

A shard's commit record lives inside the shard's directory, so a committed shard
whose directory was deleted (an `rm -rf`, a bad sync) looked like one never
extracted. Each commit therefore also writes ``commits/NAME.json`` (a self-hashed
record naming the shard's commit record by its hash), after the shard is in
place; `verify` reports a journaled shard that is gone as damage. `verify
--repair` and a rerun that re-extracts keep the journal true: a shard moved
aside is forgotten, a recommitted one journaled again. On object storage the
entry is the object ``commits/NAME.json``, created after the shard's marker.
Stores written before the journal have no ``commits/``: nothing is checked."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .. import layout
from .records import record_bytes, write_record

SUFFIX = ".json"


def entry_body(name: str, commit_record_sha256: str) -> dict:
    return {"shard": name, "commit_record_sha256": commit_record_sha256}


def entry_key(name: str) -> str:
    """The entry's path relative to the store root (a key on object storage)."""
    return f"{layout.COMMITS_DIR}/{name}{SUFFIX}"


def journal_commit(root, name: str, commit_record: dict) -> None:
    """Record that shard `name`, committed with `commit_record`, is in ``shards/``."""
    path = Path(root) / entry_key(name)
    path.parent.mkdir(exist_ok=True)
    write_record(path, entry_body(name, record_sha256(commit_record)))


def record_sha256(commit_record: dict) -> str:
    """The sha256 of a commit record's file (its canonical bytes)."""
    return hashlib.sha256(record_bytes(commit_record)).hexdigest()


def entry_bytes(name: str, commit_record: dict) -> bytes:
    """The entry as an object store holds it (the same canonical record bytes)."""
    return record_bytes(entry_body(name, record_sha256(commit_record)))


def forget(root, name: str) -> None:
    """Drop shard `name` from the journal (moved aside by `--repair`)."""
    try:
        os.unlink(Path(root) / entry_key(name))
    except FileNotFoundError:
        pass


def journaled(root) -> set[str] | None:
    """The shards the journal says were committed; None for a store without one."""
    directory = Path(root) / layout.COMMITS_DIR
    if not directory.is_dir():
        return None
    with os.scandir(directory) as entries:
        return {entry.name.removesuffix(SUFFIX) for entry in entries if entry.name.endswith(SUFFIX)}
