"""`verify`: re-read everything a store committed and name every problem.

A problem is a dict {shard, array, file, what}. Uncommitted leftovers (a crashed
writer's `.staging/` directories) are reported separately: they are invisible to
readers, so they do not make a store bad, and `clean` removes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zarr

from . import layout
from .bf16 import BFLOAT16
from .plan import is_safe_id
from .reader import CorruptShardError, Store
from .records import RecordError, check_files, describe_files, read_record


@dataclass
class Report:
    problems: list[dict] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    recomputed: list[dict] = field(default_factory=list)  # per-sample cosines from --recompute
    shards_checked: int = 0
    samples: int = 0
    tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, what: str, shard: str = "", array: str = "", file: str = "") -> None:
        self.problems.append({"shard": shard, "array": array, "file": file, "what": what})

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "leftovers": self.leftovers,
            "recomputed": self.recomputed,
            "shards_checked": self.shards_checked,
            "samples": self.samples,
            "tokens": self.tokens,
        }


def verify_store(path, progress=None) -> Report:
    """Check a store; `progress(done, total)` is called after each shard.
    FileNotFoundError where `path` holds no store at all: there is nothing to
    report on (a wrong path), unlike a store whose root is damaged."""
    path = Path(path)
    report = Report()
    try:
        store = Store(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        report.add(f"store root unreadable: {exc}", file=layout.ZARR_METADATA)
        return report
    _check_root(store, report)
    plan = _check_plan(store, report)
    report.leftovers = sorted(p.name for p in (path / layout.STAGING_DIR).glob("*")) if (
        path / layout.STAGING_DIR
    ).is_dir() else []

    shard_dirs = sorted(p.name for p in (path / layout.SHARDS_DIR).iterdir() if p.is_dir()) if (
        path / layout.SHARDS_DIR
    ).is_dir() else []
    seen_ids: dict[str, str] = {}
    planned_ids = None if plan is None else {s.name: [x.sample_id for x in s.samples] for s in plan.shards}
    for done, name in enumerate(shard_dirs, 1):
        _check_shard(store, name, planned_ids, seen_ids, report)
        if progress:
            progress(done, len(shard_dirs))
    if planned_ids is not None:
        planned = set(planned_ids)
        for name in sorted(planned - set(shard_dirs)):
            report.add("planned shard missing (not committed, or deleted)", shard=name)
        for name in sorted(set(shard_dirs) - planned):
            report.add("shard not in the plan", shard=name)
    return report


def _check_root(store: Store, report: Report) -> None:
    try:
        record = read_record(store.path / layout.ROOT_RECORD)
    except RecordError as exc:
        report.add(str(exc), file=layout.ROOT_RECORD)
        return
    for rel, what in check_files(store.path, record["files"]):
        report.add(what, file=rel)
    actual = store.fingerprint.sha256()
    if store.attrs.get("fingerprint_sha256") != actual or record["fingerprint_sha256"] != actual:
        report.add("fingerprint edited: it does not match the hash recorded at creation", file=layout.ZARR_METADATA)


def _check_plan(store: Store, report: Report):
    plan_dir = store.path / layout.PLAN_DIR
    if not plan_dir.exists():
        return None
    try:
        record = read_record(plan_dir / layout.COMMIT_RECORD)
    except RecordError as exc:
        report.add(str(exc), file=f"{layout.PLAN_DIR}/{layout.COMMIT_RECORD}")
        return None
    problems = check_files(plan_dir, record["files"])
    for rel, what in problems:
        report.add(what, file=f"{layout.PLAN_DIR}/{rel}")
    if problems:
        return None
    plan = store.plan()
    if plan.digest() != record["plan_sha256"]:
        report.add("plan content does not match its recorded hash", file=layout.PLAN_DIR)
    return plan


def _check_shard(store: Store, name: str, planned_ids, seen_ids: dict, report: Report) -> None:
    directory = layout.shard_dir(store.path, name)
    try:
        commit = store.commit(name)
    except CorruptShardError as exc:
        report.add(exc.what, shard=name, file=layout.COMMIT_RECORD)
        return
    report.shards_checked += 1
    bad_files = check_files(directory, commit.file_table)
    for rel, what in bad_files:
        report.add(what, shard=name, array=layout.array_of(rel), file=rel)
    on_disk = set(describe_files(directory, exclude=(layout.COMMIT_RECORD,)))
    for rel in sorted(on_disk - set(commit.files)):
        report.add("file not in the commit record", shard=name, file=rel)
    if commit.fingerprint_sha256 != store.fingerprint.sha256():
        report.add("shard was written under a different fingerprint", shard=name, file=layout.COMMIT_RECORD)
    if bad_files:
        return  # contents are not trustworthy; checksums already named the files
    try:
        _check_contents(store, name, commit, planned_ids, seen_ids, report)
    except Exception as exc:  # unreadable despite matching checksums: name it, keep going
        report.add(f"unreadable: {exc}", shard=name)


def _check_contents(store: Store, name: str, commit, planned_ids, seen_ids: dict, report: Report) -> None:
    fp = store.fingerprint
    group = zarr.open_group(str(layout.shard_dir(store.path, name)), mode="r")
    num_tokens, num_samples = commit.num_tokens, commit.num_samples
    expected = {
        layout.INPUT_IDS: ((num_tokens,), np.dtype(np.int32)),
        layout.LOSS_MASK: ((num_tokens,), np.dtype(np.uint8)),
        layout.SAMPLE_OFFSETS: ((num_samples + 1,), np.dtype(np.int64)),
        **{layout.layer_array(i): ((num_tokens, fp.hidden_size), BFLOAT16) for i in fp.layer_ids},
    }
    if commit.target_topk:
        k = commit.target_topk
        expected[layout.TOPK_IDS] = ((num_tokens, k), np.dtype(np.int32))
        expected[layout.TOPK_LOGPROBS] = ((num_tokens, k), np.dtype(np.float32))
    shard_path = layout.shard_dir(store.path, name)
    present = {p.parent.name for p in shard_path.glob(f"*/{layout.ZARR_METADATA}")}  # listing via zarr warns on commit.json
    problems_before = len(report.problems)
    for array_name, (shape, dtype) in expected.items():
        if array_name not in present:
            report.add("array missing", shard=name, array=array_name)
            continue
        array = group[array_name]
        if tuple(array.shape) != shape or array.dtype != dtype:
            report.add(f"shape/dtype {tuple(array.shape)} {array.dtype}, expected {shape} {dtype}", shard=name, array=array_name)
    if len(report.problems) > problems_before:
        return

    data = store.read_shard(name, verify=False)  # checksums were checked file by file above
    offsets = data.offsets
    if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) <= 0):
        report.add("offsets are not 0 .. tokens, strictly increasing", shard=name, array=layout.SAMPLE_OFFSETS)
    input_ids = data.input_ids.numpy()
    if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= fp.vocab_size):
        report.add(f"token ids outside 0..{fp.vocab_size - 1}", shard=name, array=layout.INPUT_IDS)
    if np.any(data.loss_mask.numpy() > 1):
        report.add("loss mask values other than 0/1", shard=name, array=layout.LOSS_MASK)
    sample_ids = data.sample_ids
    if len(sample_ids) != num_samples:
        report.add(f"{len(sample_ids)} sample ids for {num_samples} samples", shard=name, array=layout.SAMPLE_IDS)
    for sample_id in sample_ids:
        if not is_safe_id(sample_id):
            report.add(f"unsafe sample id {sample_id!r}", shard=name, array=layout.SAMPLE_IDS)
        elif sample_id in seen_ids:
            report.add(f"sample {sample_id!r} also stored in {seen_ids[sample_id]}", shard=name, array=layout.SAMPLE_IDS)
        seen_ids[sample_id] = name
    if planned_ids is not None and name in planned_ids and planned_ids[name] != sample_ids:
        report.add("sample ids differ from the plan", shard=name, array=layout.SAMPLE_IDS)

    for layer_id, hidden in data.hidden.items():
        bad = (~torch.isfinite(hidden)).any(dim=1).nonzero().flatten()
        if len(bad):
            report.add(
                f"{len(bad)} token(s) with NaN/Inf, first at token {int(bad[0])}",
                shard=name,
                array=layout.layer_array(layer_id),
            )
    report.samples += num_samples
    report.tokens += num_tokens


def clean_leftovers(path) -> list[str]:
    """Remove `.staging/` leftovers. Refused while a live job holds the store."""
    from .lock import StoreLock
    from .writer import remove_staging

    with StoreLock(path, job="verify --clean"):
        return remove_staging(path)


def format_report(report: Report) -> str:
    lines = [
        f"shards checked: {report.shards_checked}, samples: {report.samples}, tokens: {report.tokens}",
    ]
    for entry in report.recomputed:
        lines.append(f"recomputed {entry['shard']}/{entry['sample']}: min cosine per layer {entry['min_cosine']}")
    for p in report.problems:
        where = "/".join(x for x in (p["shard"], p["file"] or p["array"]) if x) or "store"
        lines.append(f"PROBLEM {where}: {p['what']}")
    if report.leftovers:
        lines.append(f"uncommitted leftovers in {layout.STAGING_DIR}/: {', '.join(report.leftovers)} (--clean removes them)")
    lines.append("OK: store is intact" if report.ok else f"FAILED: {len(report.problems)} problem(s)")
    return "\n".join(lines)

