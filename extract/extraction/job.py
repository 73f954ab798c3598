"""The extraction job: corpus -> plan -> Ray workers -> committed shards -> report.

    report = run_job(JobConfig(model=..., corpus=..., store=..., workers=8, device="cuda",
                               plan_settings=PlanSettings(max_length=3072)))

`run_job` checks what it can before anything is locked or planned (the model
directory, the corpus, ``--device cuda`` on a machine without CUDA when the job
starts its own Ray), takes ``STORE/.lock`` (a second live job is refused; a job
refused before it wrote anything leaves nothing behind) and runs `Extraction`
through the one sharded-job driver (`extract.jobs.driver.run_sharded`: staging
leftovers, plan or resume, free space, workers, fenced dispatch, missing shards).
What is extraction's own:

- Plan (`extract.extraction.resume`): a store holding a plan -- with or without its root, since
  the plan is committed before any worker starts -- is resumed with it if the corpus
  bytes, tokenizer and settings are unchanged (checked by hash, nothing is
  re-tokenized; paths may differ), else refused unless ``overwrite``; otherwise a
  fresh plan (`extract.extraction.planning.build_plan`) is committed into the store at once.
- Workers (`extract.extraction.worker.ExtractionWorker`, built from an `ExtractionSpec`): one
  actor per GPU or, with ``device="cpu"``, per CPU slot; CUDA workers on the PyTorch
  linear-attention fallback are warned about (or refused with
  ``require_fast_kernels``).
- `Extraction.prepare`: the one place the job's fingerprint
  (`Fingerprint.for_extraction`, from the target's identity hashed once and its facts
  as the workers loaded it, `TargetFacts`) is checked against an existing store's, or
  the store root is created with it.
- The JSON report goes into the store (`extract.extraction.report`, one file per run).

Why Ray core actors, not Ray Data: the unit of work is a whole shard that one
writer commits atomically, the worker must keep the model and a store writer for
its lifetime, and retries must be per shard and counted. An actor pool with a
driver-side queue gives exactly that in a few functions; Ray Data's ``map_batches``
would re-batch rows across shard boundaries and move the hidden states through
the object store to a separate write stage -- terabytes we never want to move.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from store_schema import Fingerprint, FingerprintMismatch, TargetFacts, response_provenance, response_sampling
from store_schema.directory.root import clear_store, looks_like_store
from store_schema.dtypes import space_needed, store_dtype
from store_schema.fingerprint import target_identity
from store_schema.layout import raw_bytes_per_token, shard_bytes_bound
from store_schema.objstore.spool import too_small_message
from store_schema.plan import Plan
from store_schema.projection import Projection, fit
from store_schema.runtime.host import is_disk_full
from store_schema.runtime.progress import Progress
from store_schema.runtime.target_config import read_target_config
from store_schema.stores import StoreBackend, backend
from store_schema.writer import ShardWriter

from ..corpus import open_corpus
from ..errors import ExtractError, disk_full_message
from ..generated_corpus import generation_of
from ..jobs.driver import Planned, ShardedJob, run_sharded
from ..jobs.kernels import fallback_kernels, slow_kernels_message
from ..jobs.output import log_to_stderr, output_locked, ready_to_start
from ..messages import ACCEPTED_FORMATS
from .config import JobConfig
from .layers import resolve_layer_ids
from .planning import build_plan, summarize
from .report import Outcome, build_report, quarantine_examples, quarantine_text, report_name
from .resume import plan_and_resume
from .worker import ExtractionSpec

# Fields a resumed job may differ in: where the model lives and the package versions.
_RESUME_TOLERATES = {"target_model", "package_versions"}


def plan_job(config: JobConfig):
    """A fresh plan: what `plan --dry-run` previews and `run` commits into a new
    store. A corpus that gives no samples is refused, naming why."""
    plan = build_plan(
        config.corpus,
        config.tokenizer_path,
        config.plan_settings,
        strict=config.strict,
        workers=config.plan_workers,
        progress=lambda records: Progress(
            "planning", records, "record", mode=config.execution.progress, interval=config.execution.progress_interval
        ),
    )
    if not plan.shards:
        summary = summarize(plan)
        quarantined = quarantine_text(summary.quarantined, summary.quarantined_by_reason)
        examples = quarantine_examples(plan.quarantined, open_corpus(config.corpus).where)
        raise ExtractError(
            f"the corpus gives no samples ({quarantined}); nothing to extract. First records: {examples}. "
            f"Records are read as {ACCEPTED_FORMATS}"
        )
    return plan


def run_job(config: JobConfig, log=None) -> dict:
    """Run (or resume) one extraction job; returns the report. Raises `ExtractError`
    (and `store_schema.StoreLockedError`, `ValueError`, `FileNotFoundError`) with a
    message meant for the user."""
    log = log or log_to_stderr
    started = time.perf_counter()
    store = backend(config.store)  # a directory or a bucket, decided here for the whole job
    if config.overwrite and not store.overwritable:
        raise ExtractError(
            f"{config.store}: a store on object storage is never overwritten in place (--overwrite); use a new prefix"
        )
    target = read_target_config(config.model)  # a model directory, before anything is locked or planned
    ready_to_start(
        config,
        store,
        looks_like_store,
        "is a non-empty directory that is not a dflash store; "
        "refusing to write into (or, with --overwrite, delete) it -- choose a new path",
    )
    layer_ids = resolve_layer_ids(target, config.layers, config.num_context_layers)
    with output_locked(store, log):
        job = Extraction(config, store, target, layer_ids, target_identity(config.model))
        run = run_sharded(job, log)
        return job.finish(run, time.perf_counter() - started, log)


class Extraction(ShardedJob):
    """`extract run` as a sharded job: its plan, workers, fingerprint and report."""

    def __init__(self, config: JobConfig, store: StoreBackend, target, layer_ids: list[int], identity: dict):
        super().__init__(
            store,
            config.execution.placement(),
            config.execution.dispatch(config.batch_shards),
            config.execution.progress_settings("extract", "sample"),
            skip_space_check=config.execution.skip_space_check,
        )
        self.config, self.target, self.layer_ids, self.identity = config, target, list(layer_ids), identity
        self.planned: Planned | None = None  # once planned
        self.store = None  # the existing store root it resumes (store_schema.Store); None: new
        self.writer: ShardWriter | None = None  # once prepared
        self.kernels: dict = {}
        self.kernel_warning: str | None = None

    @property
    def job_plan(self) -> Plan:
        """The plan this job runs (`plan` sets it before anything else reads it)."""
        if self.planned is None:
            raise RuntimeError("the extraction job is used before it planned")
        return self.planned.plan

    @property
    def store_writer(self) -> ShardWriter:
        """The store's writer (`prepare` opens it before any shard or the report is written)."""
        if self.writer is None:
            raise RuntimeError("the extraction job writes before it prepared its store")
        return self.writer

    def plan(self, log) -> Planned:
        config = self.config
        planned, self.store = plan_and_resume(config, self.output, lambda: plan_job(config), log)
        if self.store is not None:
            _refuse_other_target(self.store, config.model)
        self.planned = planned
        if planned.pending and config.spool_size is not None:
            self._check_spool(planned, config.spool_size)
        if not planned.reused:
            try:
                if config.overwrite:
                    clear_store(self.output.location)
                self.output.commit_plan(planned.plan)
            except OSError as error:
                if is_disk_full(error):
                    raise ExtractError(disk_full_message(self.output, "while writing the plan")) from None
                raise
        return planned

    def _check_spool(self, planned: Planned, spool_size: int) -> None:
        """Refuse a --spool-size that could never hold the largest pending shard
        (`store_schema.layout.shard_bytes_bound`, the bound each worker reserves)."""
        sizes = {s.name: s.num_tokens for s in planned.plan.shards}
        need = shard_bytes_bound(
            max(sizes[name] for name in planned.pending),
            self.target.hidden_size,
            len(self.layer_ids),
            self.config.target_topk or 0,
        )
        if need > spool_size:
            raise ExtractError(too_small_message(self.config.spool_dir or "the spool", spool_size, need))

    def worker_spec(self, plan):
        config = self.config
        return ExtractionSpec(
            model=str(Path(config.model).resolve()),
            tokenizer=str(Path(config.tokenizer_path).resolve()),
            corpus=str(Path(config.corpus).resolve()),
            store=self.output.address,
            spool_dir=config.spool_dir,
            spool_bytes=config.spool_size,
            layer_ids=tuple(self.layer_ids),
            settings=plan.settings,
            device=config.execution.device,
            topk=config.target_topk,
            store_dtype=config.store_dtype,
            batch_tokens=config.batch_tokens,
            torch_threads=config.execution.torch_threads(),
            trust_remote_code=config.trust_remote_code,
            require_fast_kernels=config.require_fast_kernels,
            linear_attention=config.linear_attention,
        )

    def bytes_needed(self, planned: Planned) -> int:
        """The pending shards' tokens at the store dtype's size ratio, plus the space
        check's headroom (`store_schema.dtypes.space_needed`)."""
        pending = set(planned.pending)
        tokens = sum(s.num_tokens for s in planned.plan.shards if s.name in pending)
        per_token = raw_bytes_per_token(self.target.hidden_size, len(self.layer_ids))
        expected = store_dtype(self.config.store_dtype).expected_bytes(tokens * per_token)
        return space_needed(round(expected * self._kept_share()))

    def _kept_share(self) -> float:
        """The share of each layer's values the store keeps: a resumed projected store's
        rank, or --project-rank's, over the hidden size (--project-energy's rank is known
        only once fitted: counted whole)."""
        hidden = self.target.hidden_size
        if self.store is not None:
            return self.store.fingerprint.layer_width(self.layer_ids[0]) / hidden
        return min(1.0, (self.config.project_rank or hidden) / hidden)

    def prepare(self, pool, log) -> None:
        """Create the store root with the job's fingerprint, or check an existing one's."""
        if pool is not None:
            facts = _loaded_target(pool.infos[0])
            self.kernel_warning = _kernel_warning(self.config, pool.infos)
            if self.kernel_warning:
                log(f"WARNING: {self.kernel_warning}; --require-fast-kernels refuses this")
        else:
            facts = _configured_target(self.target, self.store)
        generated_by = generation_of(self.config.corpus)
        provenance = response_provenance(generated_by, self.identity["target_weights_index_sha256"])
        projection = self._new_projection(pool, log)
        kept = projection.summary() if projection is not None else self._resumed_projection()
        fingerprint = Fingerprint.for_extraction(
            self.identity,
            self.job_plan,
            self.layer_ids,
            facts,
            target_topk=self.config.target_topk or 0,
            dtype=self.config.store_dtype,
            response_provenance=provenance,
            response_sampling=response_sampling(generated_by),
            projection=kept,
        )
        self.writer = _open_or_create(self.output, self.store, self.job_plan, fingerprint, projection)
        self.kernels = dict(facts.kernels)

    def _new_projection(self, pool, log) -> Projection | None:
        """A new projected store's directions (--project-energy / --project-rank): fitted
        on the plan's first --project-fit-tokens states, which one worker runs through
        the target before any shard (`store_schema.projection`)."""
        config = self.config
        if self.store is not None or pool is None or (config.project_energy is None and config.project_rank is None):
            return None
        plan, names, tokens = self.job_plan, [], 0
        for shard in plan.shards:
            if tokens >= config.project_fit_tokens:
                break
            names.append(shard.name)
            tokens += shard.num_tokens
        moments, fitted = pool.ask_first("second_moments", names, config.project_fit_tokens)
        projection = fit(moments, fitted, energy=config.project_energy, rank=config.project_rank)
        if not projection.directions:
            raise ExtractError(
                f"the projection would keep all {self.target.hidden_size} directions of a layer: nothing to save; "
                "lower --project-energy (or give --project-rank)"
            )
        kept = ", ".join(f"{layer}: {energy:.4f}" for layer, energy in projection.energy_kept.items())
        rank, hidden = projection.rank(self.layer_ids[0]), self.target.hidden_size
        log(f"projection: {rank} of {hidden} directions a layer, fitted on {fitted:,} tokens; energy kept {kept}")
        return projection

    def _resumed_projection(self) -> dict:
        """A resumed store keeps the projection it was made with; one made whole stays whole."""
        config = self.config
        if self.store is None:
            return {}
        if not self.store.fingerprint.projection and (config.project_energy or config.project_rank):
            raise ExtractError(
                f"{self.store.path} stores its states whole; a projection is chosen when a store is made "
                "(--overwrite to start over projected)"
            )
        return dict(self.store.fingerprint.projection)

    def finish(self, run, wall: float, log) -> dict:
        """The report of `run`, kept in the store."""
        outcome = Outcome(
            run=run.run,
            started_at=run.started_at,
            plan_seconds=run.plan_seconds,
            startup_seconds=run.startup_seconds,
            extract_seconds=run.dispatch_seconds,
            workers=run.workers,
            workers_started=run.workers_started,
            kernels=self.kernels,
            kernel_warning=self.kernel_warning,
            counts=run.counts,
            shards_committed=len(run.planned.plan.shards),
        )
        report = build_report(
            self.config, self.output, self.planned, self.layer_ids, outcome, wall=wall, leftovers=run.leftovers
        )
        try:
            self.store_writer.write_report(report_name(outcome), report)
        except OSError as error:
            if error.errno == errno.EROFS:
                log(f"{self.output} is on a read-only filesystem: the report was not stored (every shard is committed)")
            elif not is_disk_full(error):
                raise
            else:
                log("warning: disk full, the report was not stored (every shard is committed)")
        return report


def _kernel_warning(config: JobConfig, infos) -> str | None:
    """CUDA workers on the PyTorch fallback (a silent 10x otherwise), said loudly."""
    slow = [info for info in infos if config.execution.device == "cuda" and fallback_kernels(info.kernels)]
    if not slow:
        return None
    return slow_kernels_message(slow[0].kernels, f"{len(slow)} of {len(infos)} worker(s) ({slow[0].host})")


def _loaded_target(info):
    """The target's facts as a worker loaded it."""
    return TargetFacts(
        num_target_layers=info.num_layers,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        kernels=info.kernels,
    )


def _configured_target(target, store):
    """Nothing is left to compute, so no worker loads the target: its config gives
    the layer count and hidden size; the vocabulary and kernels are the store's
    (nothing this job computes depends on them)."""
    return TargetFacts(
        num_target_layers=target.num_hidden_layers,
        hidden_size=target.hidden_size,
        vocab_size=store.fingerprint.vocab_size,
        kernels=store.fingerprint.kernels,
    )


def _refuse_other_target(store, model) -> None:
    """A resumed store extracted from another checkpoint is refused before Ray starts
    or any weight loads, naming the target it recorded; `--overwrite` (which deletes
    every committed shard) only as the last resort."""
    differences = store.fingerprint.target_differences(model)
    if not differences:
        return
    recorded = store.fingerprint.target_model
    committed = len(store.committed_shards())
    raise ExtractError(
        f"{store.path} was extracted from {recorded}, and --model {model} is another checkpoint "
        f"({', '.join(differences)} differ): rerun with --model {recorded} (or a copy of that checkpoint) to "
        f"resume; only to start over with this model, --overwrite deletes the {committed} committed shard(s)"
    )


def _open_or_create(store_path: StoreBackend, store, plan, fingerprint, projection=None):
    """The one place the job meets the store root: create it with the job's
    fingerprint beside the plan committed earlier, or refuse an existing one made
    with another target or settings (`Fingerprint.check`, naming every field that
    differs)."""
    try:
        if store is None:
            return store_path.create(fingerprint, keep_plan=True, projection=projection)
        try:
            store.fingerprint.check(fingerprint, ignore=_RESUME_TOLERATES)
        except FingerprintMismatch as mismatch:
            raise ExtractError(
                f"{store_path} was made with a different target or settings: {mismatch} "
                "-- pass --overwrite to start over"
            ) from None
        writer = store_path.writer()
        writer.write_plan(plan)  # a no-op: the store holds it
        return writer
    except OSError as error:
        if is_disk_full(error):
            raise ExtractError(disk_full_message(store_path, "while creating the store")) from None
        raise
