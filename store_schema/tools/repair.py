"""Repairing a store: damaged shards are moved aside so that the job that made the
store re-extracts exactly those, byte-identical to what they held.

    python -m store_schema verify STORE --repair   # then rerun the same `extract run`

The repair lives with `verify` (not with `extract run`): verify is what finds the
damage, needs no model, GPU or Ray, and the store's layout is this package's. It
moves each shard `verify` names (damaged files, or a directory without its commit
record) from ``shards/`` into ``damaged/`` with one rename each: readers stop
seeing it at once, nothing is deleted. The next `extract run` finds those shards
uncommitted and extracts them again with the store's own plan (the same batches,
so the same bytes); once every planned shard is committed it deletes ``damaged/``
(`discard_set_aside`). A run that fails keeps it."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import layout
from ..commit.journal import forget, journaled


@dataclass
class Repair:
    """What `repair_store` did: shards moved aside, and problems no re-extraction mends."""

    moved: list[str] = field(default_factory=list)
    unrepairable: list[dict] = field(default_factory=list)  # store-level problems (root, plan)

    def to_json(self) -> dict:
        return {"moved": self.moved, "unrepairable": self.unrepairable}


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
    from ..commit.lock import StoreLock
    from ..plan_io import read_committed_plan

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


def plan_repair(plan, report) -> tuple[Repair, list[str]]:
    """The planned shards `report` names problems of, and a Repair listing the problems
    re-extraction cannot mend: all of them without a sound `plan` (None)."""
    repair = Repair()
    if plan is None:  # without a sound plan no job can re-extract a shard as it was
        repair.unrepairable = list(report.problems)
        return repair, []
    planned = {s.name for s in plan.shards}
    repair.unrepairable = [p for p in report.problems if p["shard"] not in planned]
    return repair, sorted({p["shard"] for p in report.problems if p["shard"] in planned})


def clean_dir(store, commitless: bool = True) -> tuple[list[str], list[str]]:
    """`verify --clean`: remove ``.staging/`` leftovers of a dead job and set aside the
    shard directories without a commit record (uncommitted too, but in ``shards/``,
    where they block the shard's next commit; not with `commitless=False`: `repair_store`
    moves them with the damaged ones). Returns both lists of names. Refused while a live
    job holds the store."""
    from ..commit.lock import StoreLock
    from ..writer import remove_staging

    with StoreLock(store, job="verify --clean"):
        return remove_staging(store), set_aside(store, uncommitted_shard_dirs(store) if commitless else [])
