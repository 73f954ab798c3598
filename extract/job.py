"""The extraction job: corpus -> plan -> Ray workers -> committed shards -> report.

    report = run_job(JobConfig(model=..., corpus=..., store=..., workers=8, device="cuda",
                               plan_settings=PlanSettings(max_length=3072)))

What the driver does, in order (all of it under the store's lock):

1. Take ``STORE/.lock`` (flock; a second live job is refused, a dead job's lock is
   released by the kernel) and remove the ``.staging/`` leftovers of a dead job.
   A job refused before it wrote anything leaves nothing behind (not even the lock
   file, nor the store directory if it made it).
2. Plan (`extract.resume`): a store that holds a plan is resumed with it if the
   corpus bytes, tokenizer and settings are unchanged (checked by hash, nothing is
   re-tokenized; paths may differ), else the job is refused unless ``overwrite``;
   a new store gets a fresh plan (`extract.planning.build_plan`). Committed shards
   are skipped.
3. If shards are left: start the workers (`extract.dispatch`): ``ray.init()``
   locally (dashboard off) or join ``address``; one `ExtractionWorker` actor per GPU
   (``num_gpus=1``) or, with ``device="cpu"``, per CPU slot (``num_cpus=1`` and one
   torch thread). Each loads what it captures of the target once and reports its
   kernels; CUDA workers on the PyTorch linear-attention fallback are warned about
   (or refused with ``require_fast_kernels``).
4. Open or create the store (`_open_or_create`): the one place the job's
   fingerprint (`Fingerprint.for_extraction`) is checked against an existing
   store's or a new store is created with it; then write the plan.
5. Hand the uncommitted shards out (`extract.dispatch.Dispatcher`) as numbered
   attempts of this run (`store_schema.lock.ShardFence`): a queue, lost workers'
   shards revoked and redone on fresh actors (at most ``max_attempts`` tries each),
   any other failure a worker reports (disk full, corpus changed since planning,
   device out of memory) stops the job at once with a clear message; committed
   shards stay valid and the same command resumes. At the end the fence closes (no
   attempt of this run can commit any more) and every planned shard must be there.
6. Write the JSON report into the store (`extract.report`, one file per run) and
   return it.

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
import uuid
from contextlib import ExitStack
from pathlib import Path

from store_schema.runtime.progress import Progress

from .config import JobConfig
from .errors import ExtractError, disk_full_message, is_disk_full
from .report import Outcome, build_report, report_name

# Fields a resumed job may differ in: where the model lives and the package versions.
_RESUME_TOLERATES = {"target_model", "package_versions"}


def plan_job(config: JobConfig):
    """The job's context layer ids and a fresh plan: what `plan --dry-run` previews
    and `run` writes into a new store."""
    from .layers import resolve_layer_ids
    from .planning import build_plan

    layer_ids = resolve_layer_ids(config.model, config.layers, config.num_context_layers)
    plan = build_plan(
        config.corpus,
        config.tokenizer_path,
        config.plan_settings,
        strict=config.strict,
        workers=config.plan_workers,
        progress=lambda records: Progress("planning", records, "record", mode=config.progress,
                                          interval=config.progress_interval),
    )
    return plan, layer_ids


def run_job(config: JobConfig, log=None) -> dict:
    """Run (or resume) one extraction job; returns the report. Raises `ExtractError`
    (and `store_schema.StoreLockedError`, `ValueError`, `FileNotFoundError`) with a
    message meant for the user."""
    from store_schema.runtime.target_config import read_config_json
    from store_schema.writer import looks_like_store

    from .layers import resolve_layer_ids
    from .output import output_locked, refuse_foreign_output

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    started = time.perf_counter()
    store_path = Path(config.store)
    read_config_json(config.model)  # a model directory, before anything is locked or planned
    if not Path(config.corpus).exists():
        raise FileNotFoundError(f"corpus {config.corpus} does not exist")
    refuse_foreign_output(store_path, looks_like_store, "is a non-empty directory that is not a dflash store; refusing "
                          "to write into (or, with --overwrite, delete) it -- choose a new path")
    layer_ids = resolve_layer_ids(config.model, config.layers, config.num_context_layers)
    with output_locked(store_path):
        return _run_locked(config, store_path, layer_ids, started, log)


# --------------------------------------------------------------------------- the phases


def _run_locked(config: JobConfig, store_path: Path, layer_ids: list[int], started: float, log) -> dict:
    from store_schema import Fingerprint, layout, response_provenance
    from store_schema.lock import ShardFence
    from store_schema.writer import remove_staging

    from .generated_corpus import generation_of

    from .planning import summarize
    from .resume import plan_and_resume

    leftovers = remove_staging(store_path)
    if leftovers:
        log(f"removed {len(leftovers)} uncommitted leftover(s) of a previous job from .staging/")

    outcome = Outcome(run=uuid.uuid4().hex[:8])
    plan_started = time.perf_counter()
    resume = plan_and_resume(config, store_path, lambda: plan_job(config)[0], log)
    outcome.plan_seconds = time.perf_counter() - plan_started
    plan = resume.plan
    if not plan.shards:
        summary = summarize(plan)
        raise ExtractError(
            f"the corpus gives no samples ({summary.quarantined} record(s) quarantined: "
            f"{summary.quarantined_by_reason}); nothing to extract"
        )
    if resume.skipped and resume.pending:
        log(f"resuming: {resume.skipped} of {len(plan.shards)} shard(s) already committed, "
            f"{len(resume.pending)} to go")

    with ExitStack() as stack:
        pool = None
        if resume.pending:
            from .dispatch import WorkerPool, started_workers

            count = min(config.workers, len(resume.pending))
            pool = stack.enter_context(started_workers(config, lambda: WorkerPool(config, plan, layer_ids), count))
            target = _loaded_target(pool.infos[0])
            outcome.kernel_warning = _kernel_warning(config, pool.infos, log)
        else:
            target = _configured_target(config.model, resume.store)
        fingerprint = Fingerprint.for_extraction(
            config.model, plan, layer_ids, **target, target_topk=config.target_topk or 0, dtype=config.store_dtype,
            response_provenance=response_provenance(generation_of(config.corpus), config.model),
        )
        writer = _open_or_create(store_path, resume, fingerprint, plan)
        outcome.kernels = dict(target["kernels"])
        if pool is not None:
            fence = ShardFence(store_path, outcome.run).open()
            stack.callback(fence.close)  # closed before the actors go: no attempt of this run commits after
            outcome.extract_seconds, outcome.counts = _dispatch(config, resume, pool, fence, store_path, log)
            outcome.workers, outcome.startup_seconds = pool.infos, pool.startup_seconds
            outcome.workers_started = pool.created

    remove_staging(store_path)  # what lost attempts of this run left (they can no longer commit)
    missing = [s.name for s in plan.shards if not layout.is_committed(store_path, s.name)]
    if missing:  # the report never says complete for a store that is not
        raise ExtractError(f"{len(missing)} planned shard(s) are not committed after the run ({', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''}); rerun the same command to finish them")
    outcome.shards_committed = len(plan.shards)
    report = build_report(config, store_path, resume, layer_ids, outcome,
                          wall=time.perf_counter() - started, leftovers=len(leftovers))
    try:
        writer.write_report(report_name(outcome), report)
    except OSError as error:
        if not is_disk_full(error):
            raise
        log("warning: disk full, the report was not stored (every shard is committed)")
    return report


def _kernel_warning(config: JobConfig, infos, log) -> str | None:
    """Say loudly that CUDA workers run the PyTorch fallback (a silent 10x otherwise)."""
    from .kernels import fallback_kernels, slow_kernels_message

    slow = [info for info in infos if config.device == "cuda" and fallback_kernels(info.kernels)]
    if not slow:
        return None
    message = slow_kernels_message(slow[0].kernels, f"{len(slow)} of {len(infos)} worker(s) ({slow[0].host})")
    log(f"WARNING: {message}; --require-fast-kernels refuses this")
    return message


def _loaded_target(info) -> dict:
    """The target's fingerprint facts as a worker loaded it."""
    return dict(num_target_layers=info.num_layers, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                kernels=info.kernels)


def _configured_target(model: str, store) -> dict:
    """Nothing is left to compute, so no worker loads the target: its config gives
    the layer count and hidden size; the vocabulary and kernels are the store's
    (nothing this job computes depends on them)."""
    from store_schema.runtime.target_config import read_target_config

    dims = read_target_config(model)
    return dict(num_target_layers=dims.num_hidden_layers, hidden_size=dims.hidden_size,
                vocab_size=store.fingerprint.vocab_size, kernels=store.fingerprint.kernels)


def _open_or_create(store_path: Path, resume, fingerprint, plan):
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


def _dispatch(config: JobConfig, resume, pool, fence, store_path: Path, log):
    """Seconds taken and counts of handing the pending shards out to the pool's actors."""
    from .dispatch import Dispatcher

    plan = resume.plan
    sizes = {s.name: len(s.samples) for s in plan.shards}
    progress = Progress("extract", plan.num_samples, "sample", mode=config.progress, interval=config.progress_interval,
                        initial=plan.num_samples - sum(sizes[name] for name in resume.pending), log=log)
    dispatcher = Dispatcher(
        pool,
        plan,
        resume.pending,
        store_path,
        fence,
        max_attempts=config.max_attempts,
        batch_shards=config.batch_shards,
        worker_timeout=config.worker_timeout,
        kill_driver_after_shards=config.faults.kill_driver_after_shards,
        progress=progress,
        log=log,
    )
    started = time.perf_counter()
    counts = dispatcher.run()
    return time.perf_counter() - started, counts
