"""The plan group on disk (`STORE/plan/`): one row per planned sample in six
one-chunk arrays, shard names, settings and quarantined records in its attributes.
Writing and reading live here together so the two can never disagree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import zarr

from . import layout
from .codecs import zarr_dtypes  # noqa: F401  registers bfloat16 / float8_e4m3fn with zarr
from .commit.records import describe_files, fsync_path, fsync_tree, read_record, write_record
from .commit.staging import staging_dir
from .plan import Plan, PlannedSample, PlannedShard, QuarantinedRecord


def write_plan_group(directory: Path, plan: Plan) -> None:
    """Write `plan` as a zarr group into `directory` (the caller commits it)."""
    group = zarr.open_group(str(directory), mode="w")
    rows = [(i, s) for i, shard in enumerate(plan.shards) for s in shard.samples]
    strings = np.dtypes.StringDType()
    columns = {
        layout.PLAN_SAMPLE_IDS: np.array([s.sample_id for _, s in rows], dtype=strings),
        layout.PLAN_DIGESTS: np.array([s.digest for _, s in rows], dtype=strings),
        layout.PLAN_RECORD_INDEX: np.array([s.record_index for _, s in rows], dtype=np.int64),
        layout.PLAN_NUM_TOKENS: np.array([s.num_tokens for _, s in rows], dtype=np.int32),
        layout.PLAN_NUM_LOSS_TOKENS: np.array([s.num_loss_tokens for _, s in rows], dtype=np.int32),
        layout.PLAN_SHARD_INDEX: np.array([i for i, _ in rows], dtype=np.int32),
    }
    for name, values in columns.items():
        layout.write_small_array(group, name, values)
    group.attrs.update(
        {
            "shard_names": [s.name for s in plan.shards],
            "settings": plan.settings,
            "quarantined": [q.__dict__ for q in plan.quarantined],
        }
    )


def read_committed_plan(store_path) -> Plan | None:
    """The store's plan once its commit record exists; None before (no plan yet,
    or an uncommitted leftover)."""
    if not (Path(store_path) / layout.PLAN_DIR / layout.COMMIT_RECORD).is_file():
        return None
    return read_plan(store_path)


def read_plan(store_path) -> Plan:
    """The plan a store holds (as `write_plan_group` wrote it)."""
    return plan_from_group(zarr.open_group(str(Path(store_path) / layout.PLAN_DIR), mode="r"))


def plan_from_group(group) -> Plan:
    """The plan in an open plan group (a directory's or a bucket's)."""
    attrs = group.attrs.asdict()
    columns = (
        layout.PLAN_SAMPLE_IDS,
        layout.PLAN_RECORD_INDEX,
        layout.PLAN_NUM_TOKENS,
        layout.PLAN_NUM_LOSS_TOKENS,
        layout.PLAN_DIGESTS,
        layout.PLAN_SHARD_INDEX,
    )
    *fields, shard_index = (group[name][...].tolist() for name in columns)  # Python values, in one pass each
    per_shard: list[list[PlannedSample]] = [[] for _ in attrs["shard_names"]]
    for shard, values in zip(shard_index, zip(*fields)):
        per_shard[shard].append(PlannedSample(*values))
    shards = tuple(PlannedShard(n, tuple(s)) for n, s in zip(attrs["shard_names"], per_shard))
    quarantined = tuple(QuarantinedRecord(**q) for q in attrs.get("quarantined", ()))
    return Plan(shards, quarantined, dict(attrs.get("settings", {})))


def commit_plan(path, plan: Plan) -> None:
    """Commit `plan` into the store directory `path`: written aside, listed in its
    commit record, renamed into ``plan/``. No store root is needed: a job commits its
    plan before any worker starts, so whatever fails later resumes without
    re-tokenizing the corpus. A committed plan is kept; a different one is refused."""
    path = Path(path)
    plan_dir = path / layout.PLAN_DIR
    if (plan_dir / layout.COMMIT_RECORD).exists():
        if read_record(plan_dir / layout.COMMIT_RECORD)["plan_sha256"] != plan.digest():
            raise ValueError(
                f"{path}: the store already holds a different plan (other corpus or settings); "
                "use a new store or --overwrite"
            )
        return
    staging = staging_dir(path, layout.PLAN_DIR)
    write_plan_group(staging, plan)
    write_record(staging / layout.COMMIT_RECORD, {"plan_sha256": plan.digest(), "files": describe_files(staging)})
    fsync_tree(staging)
    if plan_dir.exists():
        shutil.rmtree(plan_dir)  # an uncommitted leftover (no commit record)
    os.rename(staging, plan_dir)
    fsync_path(path)
