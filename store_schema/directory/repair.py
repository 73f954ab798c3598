"""`verify --repair` and `verify --clean` for a store in a directory, under its lock:
damaged shards renamed into ``damaged/`` (`store_schema.repair` says why), a dead job's
``.staging/`` leftovers removed."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .. import layout
from ..commit.journal import forget, journaled
from ..commit.lock import StoreLock
from ..commit.staging import remove_staging
from ..plan_io import read_committed_plan
from ..repair import Repair, plan_repair


def set_aside(store, names) -> list[str]:
    """Move shard directories `names` out of ``shards/`` into ``damaged/NAME.<UTC time>``
    (one rename each; a name already gone is skipped). Returns the names moved. Only
    for the holder of the store's lock."""
    store = Path(store)
    damaged = store / layout.DAMAGED_DIR
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for name in names:
        source = layout.shard_dir(store, name)
        if not source.is_dir():
            continue
        damaged.mkdir(exist_ok=True)
        target = damaged / f"{name}.{stamp}"
        suffix = 0
        while target.exists():
            suffix += 1
            target = damaged / f"{name}.{stamp}.{suffix}"
        os.rename(source, target)
        moved.append(name)
    return moved


def uncommitted_shard_dirs(store) -> list[str]:
    """Directories in ``shards/`` without their commit record (`layout.is_committed`):
    never read, and in the way of the shard's next commit."""
    shards = Path(store) / layout.SHARDS_DIR
    if not shards.is_dir():
        return []
    return sorted(p.name for p in shards.iterdir() if p.is_dir() and not layout.is_committed(store, p.name))


def discard_set_aside(store) -> int:
    """Delete ``damaged/``: called once every planned shard is committed again.
    Returns how many shard copies it held."""
    damaged = Path(store) / layout.DAMAGED_DIR
    if not damaged.is_dir():
        return 0
    count = sum(1 for _ in damaged.iterdir())
    shutil.rmtree(damaged)
    return count


def repair_dir(store, report) -> Repair:
    """Set aside every planned shard `report` (`store_schema.tools.verify.verify_store`'s)
    names a problem of, under the store's lock. Problems of the root or the plan are
    returned as unrepairable (a shard re-extraction cannot mend them)."""
    store = Path(store)
    plan_damaged = any(not p["shard"] and p["file"].startswith(layout.PLAN_DIR) for p in report.problems)
    repair, shards = plan_repair(None if plan_damaged else read_committed_plan(store), report)
    if shards:
        with StoreLock(store, job="verify --repair"):
            journal = journaled(store) or set()
            moved = set_aside(store, shards)
            vanished = [name for name in shards if name not in moved and name in journal]
            for name in shards:  # no longer committed: out of the journal, for the rerun to extract again
                forget(store, name)
            repair.moved = sorted(moved + vanished)
    return repair


def clean_dir(store, commitless: bool = True) -> tuple[list[str], list[str]]:
    """`verify --clean`: remove ``.staging/`` leftovers of a dead job and set aside the
    shard directories without a commit record (uncommitted too, but in ``shards/``,
    where they block the shard's next commit; not with `commitless=False`: `repair_store`
    moves them with the damaged ones). Returns both lists of names. Refused while a live
    job holds the store."""
    with StoreLock(store, job="verify --clean"):
        return remove_staging(store), set_aside(store, uncommitted_shard_dirs(store) if commitless else [])
