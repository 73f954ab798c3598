"""The one driver of a sharded job: `extract run` (`extract.extraction.job`) and `extract generate`
(`extract.generate.job`) are each a `ShardedJob` handed to `run_sharded`.

What the driver does, in order, under the output's lock (taken by the caller,
`extract.jobs.output.output_locked`):

1. Remove a dead job's ``.staging/`` leftovers.
2. Plan or resume (`ShardedJob.plan`). The plan is committed to the output before
   any worker starts, so whatever fails after planning (no GPU, a worker that cannot
   load the target, Ctrl-C during start-up, a full disk) resumes without
   re-tokenizing the corpus.
3. Set aside shard directories left in ``shards/`` without their commit record
   (`store_schema.repair`): they are redone, nothing is deleted before that.
4. Refuse when the job's size estimate for the shards left exceeds the free space
   of the output's filesystem, unless told not to (``--skip-space-check``).
5. Start the workers (`extract.jobs.pool.started_workers`) from the job's typed
   worker spec (`ShardedJob.worker_spec`), logging each one's ready time; then
   `ShardedJob.prepare` (extraction creates or checks the store with what the
   workers loaded; with nothing left to do it runs without workers).
6. Hand the pending shards out as fenced attempts (`extract.jobs.dispatch.Dispatcher`),
   with progress.
7. Every planned shard must be committed; then the shards set aside by
   `verify --repair` or step 3 are deleted: the run that replaced them succeeded.

A second kind of worker (another engine) is another worker spec: a frozen dataclass
with ``actor_class()`` and ``task``."""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from contextlib import ExitStack
from dataclasses import dataclass, field

from store_schema import layout
from store_schema.plan import Plan
from store_schema.runtime.cli import SKIP_SPACE_CHECK_FLAG
from store_schema.runtime.host import device_line
from store_schema.runtime.progress import Progress
from store_schema.stores import StoreBackend

from ..errors import ExtractError, refuse_unless_it_fits
from .dispatch import DispatchCounts, Dispatcher
from .pool import started_workers
from .settings import DispatchSettings, Placement, ProgressSettings


@dataclass(frozen=True)
class Planned:
    """The plan a run follows and what the output already holds of it."""

    plan: Plan
    reused: bool  # the output's own plan: nothing re-tokenized
    pending: list[str]  # planned shards not committed yet, in plan order

    @property
    def skipped(self) -> int:
        return len(self.plan.shards) - len(self.pending)


@dataclass
class JobRun:
    """What one run of a sharded job did, for its report."""

    run: str  # this run's id (staging names, fence, report file)
    planned: Planned
    started_at: float  # wall clock when the run began (the report's name)
    leftovers: int = 0  # `.staging/` entries of a dead job removed
    set_aside: list[str] = field(default_factory=list)  # commit-less shard directories moved aside
    plan_seconds: float = 0.0
    counts: DispatchCounts = field(default_factory=DispatchCounts)
    dispatch_seconds: float = 0.0
    workers: list = field(default_factory=list)  # extract.jobs.protocol.WorkerInfo of each first actor
    workers_started: int = 0  # replacements of lost actors included
    startup_seconds: float = 0.0


class ShardedJob(ABC):
    """One kind of sharded job: how it plans, what its workers are built from, what
    its output needs on disk, and what it does once its workers are up."""

    def __init__(
        self,
        output,
        placement: Placement,
        dispatch: DispatchSettings,
        progress: ProgressSettings,
        skip_space_check: bool = False,
    ):
        self.output: StoreBackend = output  # a directory or a bucket (`store_schema.stores.backend`)
        self.placement, self.dispatch = placement, dispatch
        self.progress, self.skip_space_check = progress, skip_space_check

    @abstractmethod
    def plan(self, log) -> Planned:
        """The plan (reused, or made and committed to the output) and the shards left."""

    @abstractmethod
    def worker_spec(self, plan):
        """The frozen dataclass every actor is built from (`extract.jobs.pool.ActorPool`)."""

    @abstractmethod
    def bytes_needed(self, planned: Planned) -> int:
        """Estimated bytes the pending shards will take on disk."""

    def prepare(self, pool, log) -> None:
        """Called once the workers are up (`pool`), or with None when nothing is left to
        do; before any shard is handed out."""


def run_sharded(job: ShardedJob, log) -> JobRun:
    """Run (or resume) `job` to completion: every planned shard committed. Raises
    `ExtractError` with a message meant for the user."""
    out, started_at = job.output.job_output(), time.time()
    if job.placement.device_note:  # after the refusals of a job that cannot start: those stay one line
        log(device_line(job.placement.device, job.placement.device_note))
    leftovers = out.remove_leftovers()
    if leftovers:
        where = "from .staging/" if out.local_path is not None else "(attempts no commit marker names)"
        log(f"removed {len(leftovers)} uncommitted leftover(s) of a previous job {where}")
    plan_started = time.perf_counter()
    planned = job.plan(log)
    result = JobRun(
        run=uuid.uuid4().hex[:8],
        planned=planned,
        started_at=started_at,
        leftovers=len(leftovers),
        plan_seconds=time.perf_counter() - plan_started,
    )
    plan, pending = planned.plan, planned.pending
    if planned.skipped and pending:
        log(f"resuming: {planned.skipped} of {len(plan.shards)} shard(s) already committed, {len(pending)} to go")
    result.set_aside = out.set_aside(pending)
    if result.set_aside:
        log(
            f"moved {len(result.set_aside)} shard directory(ies) without a commit record to "
            f"{layout.DAMAGED_DIR}/ ({', '.join(result.set_aside[:5])}); they are extracted again"
        )
    if pending and not job.skip_space_check and out.local_path is not None:
        refuse_unless_it_fits(
            out.local_path, job.bytes_needed(planned), f"the {len(pending)} shard(s) left", SKIP_SPACE_CHECK_FLAG
        )
    with ExitStack() as stack:
        if not pending:
            job.prepare(None, log)
        else:
            progress = job_progress(job.progress, plan, pending, log)
            count = min(job.placement.workers, len(pending))
            pool = stack.enter_context(
                started_workers(job.placement, job.worker_spec(plan), count, log, job.progress.interval)
            )
            job.prepare(pool, log)
            fence = out.fence(result.run)
            stack.callback(fence.close)  # closed before the actors go: no attempt of this run commits after
            dispatcher = Dispatcher(pool, plan, pending, fence, job.dispatch, progress=progress, log=log, output=out)
            begun = time.perf_counter()
            result.counts = dispatcher.run()
            result.dispatch_seconds = time.perf_counter() - begun
            result.workers, result.startup_seconds = pool.infos, pool.startup_seconds
            result.workers_started = pool.created
    if pending:
        out.remove_leftovers()  # what lost attempts of this run left (they can no longer commit)
    finish(out, plan, log)
    return result


def job_progress(settings: ProgressSettings, plan: Plan, pending: list[str], log) -> Progress:
    """The job's progress over the plan's samples, the committed shards' counted as done."""
    sizes = {s.name: len(s.samples) for s in plan.shards}
    return Progress(
        settings.desc,
        plan.num_samples,
        settings.unit,
        mode=settings.mode,
        interval=settings.interval,
        log=log,
        initial=plan.num_samples - sum(sizes[name] for name in pending),
    )


def finish(out, plan: Plan, log) -> None:
    """Every planned shard must be committed (the report never says complete for an
    output that is not); then the damaged copies set aside are deleted."""
    missing = out.uncommitted([s.name for s in plan.shards])
    if missing:
        raise ExtractError(
            f"{len(missing)} planned shard(s) are not committed after the run ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}); rerun the same command to finish them"
        )
    discarded = out.discard_set_aside()
    if discarded:
        log(
            f"every planned shard is committed: deleted the {discarded} damaged shard copy(ies) set aside in "
            f"{layout.DAMAGED_DIR}/"
        )
