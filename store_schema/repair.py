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
(`directory.repair.discard_set_aside`). A run that fails keeps it.

Both backends repair through this plan: `directory.repair` (renames into ``damaged/``) and
`objstore.repair` (deletes markers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Repair:
    """What `repair_store` did: shards moved aside, and problems no re-extraction mends."""

    moved: list[str] = field(default_factory=list)
    unrepairable: list[dict] = field(default_factory=list)  # store-level problems (root, plan)

    def to_json(self) -> dict:
        return {"moved": self.moved, "unrepairable": self.unrepairable}


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
