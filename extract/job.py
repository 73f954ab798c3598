"""The extraction job: corpus -> plan -> Ray workers -> committed shards -> report.

    report = run_job(JobConfig(model=..., corpus=..., store=..., workers=8, device="cuda",
                               plan_settings=PlanSettings(max_length=3072)))

What the driver does, in order (all of it under the store's lock):

1. Take ``STORE/.lock`` (flock; a second live job is refused, a dead job's lock is
   released by the kernel) and remove the ``.staging/`` leftovers of a dead job.
2. Plan the corpus (`extract.planning.build_plan`) and read what the store holds
   (`_resume_state`): a store that already holds a plan must hold this one (same
   corpus content, tokenizer and settings), else the job is refused unless
   ``overwrite``; its committed shards are skipped.
3. If shards are left: start the workers (`extract.dispatch`): ``ray.init()``
   locally (dashboard off) or join ``address``; one `ExtractionWorker` actor per GPU
   (``num_gpus=1``) or, with ``device="cpu"``, per CPU slot (``num_cpus=1`` and one
   torch thread). Each loads the target once and reports its kernels.
4. Open or create the store (`_open_or_create`): the one place the job's
   fingerprint (`Fingerprint.for_extraction`) is checked against an existing
   store's or a new store is created with it; then write the plan.
5. Hand the uncommitted shards out (`extract.dispatch.Dispatcher`): a queue, dead
   workers' shards redone on fresh actors (at most ``max_attempts`` tries each),
   any other failure a worker reports (disk full, corpus changed since planning,
   device out of memory) stops the job at once with a clear message; committed
   shards stay valid and the same command resumes.
6. Write the JSON report into the store (``reports/extract.json``) and return it.

Why Ray core actors, not Ray Data: the unit of work is a whole shard that one
writer commits atomically, the worker must keep the model and a store writer for
its lifetime, and retries must be per shard and counted. An actor pool with a
driver-side queue gives exactly that in ~100 lines; Ray Data's ``map_batches``
would re-batch rows across shard boundaries and move the hidden states through
the object store to a separate write stage -- terabytes we never want to move.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .config import JobConfig
from .errors import ExtractError, disk_full_message, is_disk_full
from .dispatch import DispatchCounts

if TYPE_CHECKING:
    from store_schema import Store

# Fields a resumed job may differ in: where the model lives and the package versions.
_RESUME_TOLERATES = {"target_model", "package_versions"}


def plan_job(config: JobConfig):
    """The job's context layer ids and plan: what `run` writes and `plan --dry-run` previews."""
    from .layers import resolve_layer_ids
    from .planning import build_plan

    layer_ids = resolve_layer_ids(config.model, config.layers, config.num_context_layers)
    plan = build_plan(
        config.corpus,
        config.tokenizer_path,
        config.plan_settings,
        strict=config.strict,
        workers=config.plan_workers,
        progress=config.progress,
    )
    return plan, layer_ids


def run_job(config: JobConfig, log=None) -> dict:
    """Run (or resume) one extraction job; returns the report. Raises `ExtractError`
    (and `store_schema.StoreLockedError`, `ValueError`, `FileNotFoundError`) with a
    message meant for the user."""
    from store_schema import StoreLock
    from store_schema.target_config import read_config_json
    from store_schema.writer import looks_like_store, store_entries

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    started = time.perf_counter()
    store_path = Path(config.store)
    read_config_json(config.model)  # a model directory, before anything is locked or planned
    if not Path(config.corpus).exists():
        raise FileNotFoundError(f"corpus {config.corpus} does not exist")
    if store_path.exists() and not store_path.is_dir():
        raise ExtractError(f"{store_path} exists and is not a directory")
    if store_entries(store_path) and not looks_like_store(store_path):
        raise ExtractError(
            f"{store_path} is a non-empty directory that is not a dflash store; refusing to write into "
            "(or, with --overwrite, delete) it -- choose a new path"
        )

    lock = StoreLock(store_path, job=f"extract {' '.join(sys.argv[1:])}"[:2000]).acquire()
    try:
        return _run_locked(config, store_path, started, log)
    finally:
        lock.release()


# --------------------------------------------------------------------------- the phases


@dataclass(frozen=True)
class _Resume:
    """What an existing store means for this job."""

    store: Store | None  # the store to resume; None: create one (new, overwritten or never finished)
    pending: list[str]  # planned shards not committed yet, in plan order
    skipped: int  # planned shards already committed


@dataclass
class _Outcome:
    """What the run did, gathered for the report."""

    plan_seconds: float = 0.0
    startup_seconds: float = 0.0
    extract_seconds: float = 0.0
    workers: list = field(default_factory=list)  # WorkerInfo of each started actor
    workers_started: int = 0  # replacements of dead actors included
    kernels: dict = field(default_factory=dict)
    counts: DispatchCounts = field(default_factory=DispatchCounts)


def _run_locked(config: JobConfig, store_path: Path, started: float, log) -> dict:
    from store_schema import Fingerprint
    from store_schema.writer import remove_staging

    from .planning import summarize

    leftovers = remove_staging(store_path)
    if leftovers:
        log(f"removed {len(leftovers)} uncommitted leftover(s) of a previous job from .staging/")

    outcome = _Outcome()
    plan_started = time.perf_counter()
    plan, layer_ids = plan_job(config)
    outcome.plan_seconds = time.perf_counter() - plan_started
    if not plan.shards:
        summary = summarize(plan)
        raise ExtractError(
            f"the corpus gives no samples ({summary.quarantined} record(s) quarantined: "
            f"{summary.quarantined_by_reason}); nothing to extract"
        )

    resume = _resume_state(config, store_path, plan)
    if resume.skipped:
        log(f"resuming: {resume.skipped} of {len(plan.shards)} shard(s) already committed, "
            f"{len(resume.pending)} to go")

    with ExitStack() as stack:
        pool = None
        if resume.pending:
            from .dispatch import started_workers

            count = min(config.workers, len(resume.pending))
            pool = stack.enter_context(started_workers(config, plan, layer_ids, count))
            target = _loaded_target(pool.infos[0])
        else:
            target = _configured_target(config.model, resume.store)
        fingerprint = Fingerprint.for_extraction(
            config.model, plan, layer_ids, **target, target_topk=config.target_topk or 0, dtype=config.store_dtype
        )
        writer = _open_or_create(store_path, resume, fingerprint, plan)
        outcome.kernels = dict(target["kernels"])
        if pool is not None:
            outcome.extract_seconds, outcome.counts = _dispatch(config, plan, resume.pending, pool, store_path, log)
            outcome.workers, outcome.startup_seconds = pool.infos, pool.startup_seconds
            outcome.workers_started = pool.created

    report = _report(config, store_path, plan, layer_ids, resume, outcome,
                     wall=time.perf_counter() - started, leftovers=len(leftovers))
    try:
        writer.write_report("extract", report)
    except OSError as error:
        if not is_disk_full(error):
            raise
        log("warning: disk full, the report was not stored (every shard is committed)")
    return report


def _resume_state(config: JobConfig, store_path: Path, plan) -> _Resume:
    """Which planned shards are left. A store that holds another plan, or committed
    shards without a plan, is refused: its shards belong to other settings."""
    from store_schema import Store, layout
    from store_schema.writer import store_entries

    everything = [s.name for s in plan.shards]
    if config.overwrite or not store_entries(store_path):
        return _Resume(None, everything, 0)
    if not (store_path / layout.ROOT_RECORD).is_file():
        return _Resume(None, everything, 0)  # never finished creating: no plan, no shards, nothing to lose
    store = Store(store_path)
    committed = set(store.committed_shards())
    old_plan = store.plan()
    if old_plan is not None and old_plan.digest() != plan.digest():
        raise ExtractError(
            f"{store_path} holds a different plan ({_describe_plan_difference(old_plan, plan)}); "
            "rerun with the settings it was made with, use a new store, or pass --overwrite to start over"
        )
    if old_plan is None and committed:
        raise ExtractError(f"{store_path} has committed shards but no plan; use --overwrite or a new store")
    pending = [name for name in everything if name not in committed]
    return _Resume(store, pending, len(everything) - len(pending))


def _describe_plan_difference(old, new) -> str:
    a, b = old.settings, new.settings
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if keys:
        return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:6])
    return "same settings, different samples or shards"


def _loaded_target(info) -> dict:
    """The target's fingerprint facts as a worker loaded it."""
    return dict(num_target_layers=info.num_layers, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                kernels=info.kernels)


def _configured_target(model: str, store) -> dict:
    """Nothing is left to compute, so no worker loads the target: its config gives
    the layer count and hidden size; the vocabulary and kernels are the store's
    (nothing this job computes depends on them)."""
    from store_schema.target_config import read_target_config

    dims = read_target_config(model)
    return dict(num_target_layers=dims.num_hidden_layers, hidden_size=dims.hidden_size,
                vocab_size=store.fingerprint.vocab_size, kernels=store.fingerprint.kernels)


def _open_or_create(store_path: Path, resume: _Resume, fingerprint, plan):
    """The one place the job meets the store: create it with the job's fingerprint,
    or refuse an existing one made with another target or settings (`Fingerprint.check`,
    naming every field that differs); then write the plan (a no-op if it is there)."""
    from store_schema import FingerprintMismatch, StoreWriter, create_store

    try:
        if resume.store is None:
            writer = create_store(store_path, fingerprint, overwrite=True)
        else:
            try:
                resume.store.fingerprint.check(fingerprint, ignore=_RESUME_TOLERATES)
            except FingerprintMismatch as mismatch:
                raise ExtractError(
                    f"{store_path} was made with a different target or settings: {mismatch} "
                    "-- pass --overwrite to start over"
                ) from None
            writer = StoreWriter(store_path)
        writer.write_plan(plan)
    except OSError as error:
        if is_disk_full(error):
            raise ExtractError(disk_full_message(store_path, "while creating the store or writing its plan")) from None
        raise
    return writer


def _dispatch(config: JobConfig, plan, pending: list[str], pool, store_path: Path, log) -> tuple[float, DispatchCounts]:
    """Seconds taken and counts of handing `pending` out to the pool's actors."""
    from .dispatch import Dispatcher

    dispatcher = Dispatcher(
        pool,
        plan,
        pending,
        store_path,
        max_attempts=config.max_attempts,
        inflight_per_worker=config.inflight_per_worker,
        kill_driver_after_shards=config.faults.kill_driver_after_shards,
        progress=config.progress,
        log=log,
    )
    started = time.perf_counter()
    counts = dispatcher.run()
    return time.perf_counter() - started, counts


def _report(config: JobConfig, store_path: Path, plan, layer_ids, resume: _Resume, outcome: _Outcome,
            *, wall: float, leftovers: int) -> dict:
    """The job's JSON report (printed last by `run`, stored as ``reports/extract.json``)."""
    from .planning import summarize

    summary = summarize(plan)
    counts = outcome.counts
    seconds = outcome.extract_seconds
    return {
        "status": "complete",
        "store": str(store_path.resolve()),
        "plan_digest": plan.digest(),
        "samples": plan.num_samples,
        "tokens": plan.num_tokens,
        "shards": len(plan.shards),
        "samples_written": counts.samples_written,
        "tokens_written": counts.tokens_written,
        "shards_written": counts.shards_written,
        "shards_skipped": resume.skipped,
        "shards_committed_elsewhere": counts.shards_committed_elsewhere,
        "shards_retried": counts.shards_retried,
        "shards_committed_before_worker_death": counts.shards_committed_before_worker_death,
        "worker_deaths": counts.worker_deaths,
        "quarantined": summary.quarantined,
        "quarantined_by_reason": summary.quarantined_by_reason,
        "layer_ids": list(layer_ids),
        "target_topk": int(config.target_topk or 0),
        "workers": len(outcome.workers),
        "workers_started": outcome.workers_started,
        "device": config.device,
        "devices": sorted({w.device for w in outcome.workers}),
        "hosts": sorted({w.host for w in outcome.workers}),
        "kernels": outcome.kernels,
        "bytes_written": counts.bytes_written,
        "raw_bytes_written": counts.raw_bytes_written,
        "tokens_per_s": round(counts.tokens_written / seconds, 2) if seconds else 0.0,
        "bytes_per_s": round(counts.bytes_written / seconds, 2) if seconds else 0.0,
        "wall_seconds": round(wall, 3),
        "plan_seconds": round(outcome.plan_seconds, 3),
        "startup_seconds": round(outcome.startup_seconds, 3),
        "extract_seconds": round(seconds, 3),
        "leftovers_cleaned": leftovers,
    }
