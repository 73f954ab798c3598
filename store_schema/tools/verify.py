"""`verify`: re-read everything a store committed and name every problem.

A problem is a dict {shard, array, file, what}. Uncommitted leftovers (a crashed
writer's `.staging/` directories) are reported separately: they are invisible to
readers, so they do not make a store bad, and `clean` removes them.

Shards are checked in parallel (`workers` threads: file reads, crc32c, chunk decode
and the bit tests below all release the GIL), each file is read once (its size and
crc32c checked on the bytes then decoded from them), and NaN/Inf is found on the
raw bits (an exponent of all ones) rather than through a float conversion.
`checksums_only` stops after the size + crc32c of every committed file (on object
storage, where the marker recorded the ETags the uploads were answered with: the
listed ETags instead, nothing read, `Store.kept_checksum_problems`);
`sizes_only` reads no shard file at all: commit records and file sizes against
the directory listing (a quick pass over every shard's metadata; `fit`'s start
reads none of it, the loader checking each shard's record and crc32c as it reads)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .. import layer_stats, layout
from ..commit.journal import entry_key
from ..commit.records import RecordError, file_mismatch, size_mismatch
from ..dtypes import nonfinite_rows
from ..plan import is_safe_id
from ..reader import StoreReader, as_bits
from ..runtime.crc32c import crc32c_bytes
from ..runtime.host import available_cores
from ..shard_decoder import CorruptShardError
from ..stores import open_store
from .verify_report import MISSING_SHARD, NOT_CHECKED, VANISHED, Report, problem

SIZES, CHECKSUMS, CONTENTS = "sizes", "checksums", "contents"  # how deep a shard is checked


@dataclass
class _ShardResult:
    """One shard's findings, merged into the report in shard order."""

    name: str
    problems: list[dict] = field(default_factory=list)
    checked: bool = False
    sample_ids: list[str] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    bytes_read: int = 0
    layer_stats: dict = field(default_factory=dict)  # layer id -> LayerStats, for the store-wide median
    node: str = ""  # the Ray node that checked it (`verify --ray`)
    kept_checksums: bool = False  # checked by the storage's kept checksums, not by reading

    def add(self, what: str, array: str = "", file: str = "") -> None:
        self.problems.append(problem(what, self.name, array, file))


def verify_store(
    path,
    progress=None,
    workers: int | None = None,
    checksums_only: bool = False,
    shards=None,
    sizes_only: bool = False,
    ray_address: str | None = None,
) -> Report:
    """Check a store (a path, or a `StoreReader` already open: its commit records are
    read once) with `workers` threads (default: the cores available);
    `progress(done_shards, total_shards, bytes_done, total_bytes)` is called after
    each shard. `ray_address`: the shards are checked across that Ray cluster's
    nodes (`verify_cluster`; "auto": this machine's cluster) instead of by `workers`
    threads here. `shards`: check only these shard directories (the processes of a
    job share the work out), and not which planned shards are missing.
    FileNotFoundError where `path` holds no store at all: there is nothing to
    report on (a wrong path), unlike a store whose root is damaged."""
    report = Report(checksums_only=checksums_only and not sizes_only, sizes_only=sizes_only)
    try:
        store = path if isinstance(path, StoreReader) else open_store(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        report.add(f"store root unreadable: {exc}", file=layout.ZARR_METADATA)
        return report
    _check_root(store, report)
    plan = _check_plan(store, report)
    journal = store.journaled_shards() or set()
    if not sizes_only:  # fit's start reads no more than it must
        _check_journal(store, journal, report, shards)
    report.leftovers = store.leftovers()
    shard_dirs = store.shard_entries() if shards is None else sorted(set(store.shard_entries()) & set(shards))
    planned_ids = None if plan is None else {s.name: [x.sample_id for x in s.samples] for s in plan.shards}
    total_bytes = sum(_committed_bytes(store, name) for name in shard_dirs) if progress else 0
    seen_ids: dict[str, str] = {}
    stats_by_shard: dict[str, dict] = {}
    done_bytes = 0
    depth = SIZES if sizes_only else CHECKSUMS if checksums_only else CONTENTS
    if ray_address is None:
        results = _checked_here(store, shard_dirs, planned_ids, depth, workers)
    else:
        results = _checked_on_cluster(store, shard_dirs, planned_ids, depth, ray_address)
    for done, result in enumerate(results, 1):  # in shard order, whatever order they finish in
        _merge(result, seen_ids, report)
        stats_by_shard[result.name] = result.layer_stats
        done_bytes += result.bytes_read
        if progress:
            progress(done, len(shard_dirs), done_bytes, total_bytes)
    _flag_outlier_layers(stats_by_shard, report)
    if shards is None:
        report.problems.extend(vanished(journal, shard_dirs))
    if planned_ids is not None and shards is None:
        _check_against_plan(set(planned_ids), set(shard_dirs), journal, report)
    return report


def vanished(journal: set[str], found) -> list[dict]:
    """A problem for each shard the store's commit journal records that is not among
    `found`: a committed shard that is gone is damage, not an unfinished job."""
    return [problem(VANISHED, shard=name, file=entry_key(name)) for name in sorted(journal - set(found))]


def _check_against_plan(planned: set[str], found: set[str], journal: set[str], report: Report) -> None:
    """Planned shards not in the store and never committed (not extracted yet), and
    shards the plan does not name."""
    report.planned_shards = len(planned)
    for name in sorted(planned - found - journal):
        report.add(MISSING_SHARD, shard=name)
    for name in sorted(found - planned):
        report.add("shard not in the plan", shard=name)


def _checked_here(store: StoreReader, names: list[str], planned_ids, depth: str, workers: int | None):
    """Each shard's result, in `names` order, checked to `depth` by this machine's threads."""
    with ThreadPoolExecutor(max(1, workers or available_cores())) as pool:
        yield from pool.map(lambda name: _check_shard(store, name, planned_ids, depth), names)


def check_batch(location: str, names: list[str], planned_ids, depth: str) -> list[_ShardResult]:
    """One cluster task's share (`verify_cluster`): these shards of the store at
    `location`, checked as a local verify checks them, with the node's cores."""
    return list(_checked_here(open_store(location), names, planned_ids, depth, None))


def _checked_on_cluster(store: StoreReader, names: list[str], planned_ids, depth: str, address: str):
    """Each shard's result, in `names` order, checked across the Ray cluster at `address`."""
    from .verify_cluster import cluster_results  # Ray is loaded only for --ray

    location = str(store.path)  # a directory, or a bucket store's URL
    if "://" not in location:
        location = os.path.abspath(location)  # each node's workers start elsewhere

    def batch_args(batch: list[str]) -> tuple:
        planned = None if planned_ids is None else {name: planned_ids[name] for name in batch if name in planned_ids}
        return planned, depth

    def unchecked(name: str, error: str) -> _ShardResult:
        result = _ShardResult(name)
        result.add(NOT_CHECKED.format(error=error))
        return result

    return cluster_results(location, names, check_batch, batch_args, address, unchecked)


def _committed_bytes(store: StoreReader, name: str) -> int:
    try:
        return store.commit(name).disk_bytes
    except CorruptShardError:
        return 0


def _merge(result: _ShardResult, seen_ids: dict, report: Report) -> None:
    report.problems.extend(result.problems)
    report.shards_checked += result.checked
    report.samples += result.samples
    report.tokens += result.tokens
    report.bytes_read += result.bytes_read
    report.kept_checksum_shards += result.kept_checksums
    if result.node:
        report.shards_by_node[result.node] = report.shards_by_node.get(result.node, 0) + 1
    for sample_id in result.sample_ids:  # across shards, so after each shard's own checks
        if sample_id in seen_ids:
            report.add(
                f"sample {sample_id!r} also stored in {seen_ids[sample_id]}", shard=result.name, array=layout.SAMPLE_IDS
            )
        seen_ids.setdefault(sample_id, result.name)


def _check_root(store: StoreReader, report: Report) -> None:
    try:
        record = store.store_record(layout.ROOT_RECORD)
    except RecordError as exc:
        report.add(str(exc), file=layout.ROOT_RECORD)
        return
    for rel, what in store.store_file_problems(record["files"]):
        report.add(what, file=rel)
    actual = store.fingerprint.sha256()
    if store.attrs.get("fingerprint_sha256") != actual or record["fingerprint_sha256"] != actual:
        report.add("fingerprint edited: it does not match the hash recorded at creation", file=layout.ZARR_METADATA)
    try:
        store.projection()
    except (RecordError, ValueError) as exc:
        report.add(str(exc), file=layout.PROJECTION_FILE)


def _check_journal(store: StoreReader, journal: set[str], report: Report, shards=None) -> None:
    """Each commit-journal entry (of `shards`, when given) is a sound record."""
    for name in sorted(journal if shards is None else journal & set(shards)):
        try:
            store.journal_entry(name)
        except RecordError as exc:
            report.add(str(exc), shard=name, file=entry_key(name))


def _check_plan(store: StoreReader, report: Report):
    if not store.has_plan_files():
        return None
    try:
        record = store.store_record(f"{layout.PLAN_DIR}/{layout.COMMIT_RECORD}")
    except RecordError as exc:
        report.add(str(exc), file=f"{layout.PLAN_DIR}/{layout.COMMIT_RECORD}")
        return None
    problems = store.store_file_problems({f"{layout.PLAN_DIR}/{rel}": entry for rel, entry in record["files"].items()})
    for rel, what in problems:
        report.add(what, file=rel)
    if problems:
        return None
    plan = store.plan()
    if plan is None or plan.digest() != record["plan_sha256"]:
        report.add("plan content does not match its recorded hash", file=layout.PLAN_DIR)
    return plan


def _check_shard(store: StoreReader, name: str, planned_ids, depth: str) -> _ShardResult:
    result = _ShardResult(name)
    try:
        commit = store.commit(name)
    except CorruptShardError as exc:
        result.add(exc.what, file=layout.COMMIT_RECORD)
        return result
    result.checked = True
    kept = store.kept_checksum_problems(name) if depth == CHECKSUMS else None
    if kept is not None:  # the storage's own checksums: nothing read
        result.kept_checksums = True
        for rel, what in kept:
            result.add(what, array=layout.array_of(rel), file=rel)
    files = {} if depth == SIZES or kept is not None else _read_files(store, name, commit, result)
    sizes = store.shard_file_sizes(name)
    if depth == SIZES:
        _check_sizes(commit, sizes, result)
    bad = bool(result.problems)  # a file's bytes or size
    for rel in sorted(set(sizes) - set(commit.files)):
        result.add("file not in the commit record", file=rel)
    if commit.fingerprint_sha256 != store.fingerprint.sha256():
        result.add("shard was written under a different fingerprint", file=layout.COMMIT_RECORD)
    if depth != CONTENTS and not bad:
        result.samples, result.tokens = commit.num_samples, commit.num_tokens  # as committed; not decoded
        for layer_id, stats in commit.layer_stats.items():  # as recorded (none in older stores): not recomputed
            for what in layer_stats.problems(stats):
                result.add(what, array=layout.layer_array(layer_id), file=layout.COMMIT_RECORD)
            result.layer_stats[layer_id] = stats
    if bad or depth != CONTENTS:
        return result  # contents are not trustworthy, or not asked for; checksums named the files
    try:
        _check_contents(store, commit, files, planned_ids, result)
    except Exception as exc:  # unreadable despite matching checksums: name it, keep going
        result.add(f"unreadable: {exc}")
    return result


def _read_files(store: StoreReader, name: str, commit, result: _ShardResult) -> dict:
    """{rel: bytes} of every committed file, each checked against its size and crc32c."""
    files = {}
    for rel, entry in commit.file_table.items():
        what: str | None
        try:
            data = store.shard_file(name, rel)
        except FileNotFoundError:
            what = "file missing"
        else:
            files[rel] = data
            result.bytes_read += len(data)
            what = file_mismatch(entry, len(data), lambda: crc32c_bytes(data))
        if what:
            result.add(what, array=layout.array_of(rel), file=rel)
    return files


def _check_sizes(commit, sizes: dict[str, int], result: _ShardResult) -> None:
    """Every committed file is there at its committed size (nothing read)."""
    for rel, entry in commit.file_table.items():
        what = "file missing" if rel not in sizes else size_mismatch(entry, sizes[rel])
        if what:
            result.add(what, array=layout.array_of(rel), file=rel)


def _expected_arrays(store: StoreReader, commit) -> dict[str, tuple[tuple, str]]:
    """array name -> (shape, zarr data type) of every array the shard must hold."""
    fp, tokens = store.fingerprint, commit.num_tokens
    expected: dict[str, tuple[tuple[int, ...], str]] = {
        layout.INPUT_IDS: ((tokens,), "int32"),
        layout.LOSS_MASK: ((tokens,), "uint8"),
        layout.SAMPLE_OFFSETS: ((commit.num_samples + 1,), "int64"),
    }
    for layer_id in fp.layer_ids:
        width, dtype = fp.layer_width(layer_id), store.dtype
        expected[layout.layer_array(layer_id)] = ((tokens, dtype.stored_columns(width)), dtype.zarr_name)
        if dtype.scaled:
            expected[layout.scale_array(layer_id)] = (dtype.scale_shape(tokens, width), dtype.scale_zarr_name)
    if commit.target_topk:
        expected[layout.TOPK_IDS] = ((tokens, commit.target_topk), "int32")
        expected[layout.TOPK_LOGPROBS] = ((tokens, commit.target_topk), "float32")
    return expected


def _check_contents(store: StoreReader, commit, files: dict, planned_ids, result: _ShardResult) -> None:
    fp, name = store.fingerprint, result.name
    num_tokens, num_samples = commit.num_tokens, commit.num_samples
    problems_before = len(result.problems)
    for array, (shape, data_type) in _expected_arrays(store, commit).items():
        meta_file = f"{array}/{layout.ZARR_METADATA}"
        if meta_file not in files:
            result.add("array missing", array=array)
            continue
        meta = json.loads(bytes(files[meta_file]))
        if tuple(meta["shape"]) != shape or meta["data_type"] != data_type:
            result.add(
                f"shape/dtype {tuple(meta['shape'])} {meta['data_type']}, expected {shape} {data_type}", array=array
            )
    if len(result.problems) > problems_before:
        return

    data = store.decode_files(name, files)
    offsets = data.offsets
    if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) <= 0):
        result.add("offsets are not 0 .. tokens, strictly increasing", array=layout.SAMPLE_OFFSETS)
    input_ids = data.input_ids.numpy()
    if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= fp.vocab_size):
        result.add(f"token ids outside 0..{fp.vocab_size - 1}", array=layout.INPUT_IDS)
    if np.any(data.loss_mask.numpy() > 1):
        result.add("loss mask values other than 0/1", array=layout.LOSS_MASK)
    sample_ids = data.sample_ids
    if len(sample_ids) != num_samples:
        result.add(f"{len(sample_ids)} sample ids for {num_samples} samples", array=layout.SAMPLE_IDS)
    for sample_id in sample_ids:
        if not is_safe_id(sample_id):
            result.add(f"unsafe sample id {sample_id!r}", array=layout.SAMPLE_IDS)
    if planned_ids is not None and name in planned_ids and planned_ids[name] != sample_ids:
        result.add("sample ids differ from the plan", array=layout.SAMPLE_IDS)

    for layer_id, states in data.hidden.items():
        bad = nonfinite_rows(as_bits(states, store.dtype), store.dtype)
        if len(bad):
            result.add(
                f"{len(bad)} token(s) with NaN/Inf, first at token {int(bad[0])}", array=layout.layer_array(layer_id)
            )
    for layer_id, scales in data.scales.items():
        bad = store.dtype.lossy.bad_scale_tokens(scales.numpy())
        if len(bad):
            result.add(
                f"{len(bad)} scale(s) {store.dtype.lossy.BAD_SCALE}, first at token {int(bad[0])}",
                array=layout.scale_array(layer_id),
            )
    _check_layer_statistics(store, commit, data, result)
    result.sample_ids = sample_ids
    result.samples += num_samples
    result.tokens += num_tokens


def _check_layer_statistics(store: StoreReader, commit, data, result: _ShardResult) -> None:
    """Each layer's states carry signal (`store_schema.layer_stats`): statistics
    recomputed from the data, checked on their own, against those the commit
    recorded (older stores recorded none: checked from the data alone), and kept
    for the store-wide median (`_flag_outlier_layers`)."""
    for layer_id, states in data.hidden.items():
        scales = data.scales[layer_id].numpy() if layer_id in data.scales else None
        computed = layer_stats.layer_stats(as_bits(states, store.dtype).view(store.dtype.values), scales, store.dtype)
        array = layout.layer_array(layer_id)
        for what in layer_stats.problems(computed):
            result.add(what, array=array)
        recorded = commit.layer_stats.get(layer_id)
        if recorded is not None and layer_stats.differs(recorded, computed):
            result.add(
                f"states differ from the statistics recorded at commit (RMS {computed.rms:g} vs {recorded.rms:g}, "
                f"token spread {computed.token_spread:g} vs {recorded.token_spread:g}): rewritten after the "
                "commit",
                array=array,
            )
        result.layer_stats[layer_id] = computed


def _flag_outlier_layers(stats_by_shard: dict, report: Report) -> None:
    for shard, layer_id, what in layer_stats.outliers(stats_by_shard):
        report.add(what, shard=shard, array=layout.layer_array(layer_id))
