"""The driver's side of the Ray workers: starting Ray, the actor pool, and the
queue that hands shards out and takes replies in (`Dispatcher`).

Every actor holds at most ``inflight_per_worker`` shards and gets the next one when
one finishes, so fast workers take more. An actor whose process dies has its
shards put back at the front of the queue (those whose commit landed before it
died are counted, never recomputed) and is replaced; a shard gets at most
``max_attempts`` tries. Any failure a worker reports (`ShardFailed`) stops the job
with a message that says what to do."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .config import JobConfig
from .errors import ExtractError, disk_full_message
from .worker import ShardDone, ShardFailed, WorkerInfo

# --------------------------------------------------------------------------- Ray


def start_ray(config: JobConfig) -> bool:
    """Connect to Ray. Returns True if this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=True, logging_level="WARNING")
    if config.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=config.address, **quiet)  # a running cluster (or `ray job submit`)
        return True
    needed = config.workers * config.cpus_per_worker if config.device == "cpu" else config.workers
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, needed),
        include_dashboard=False,  # no dashboard / job server for a local run
        **quiet,
    )
    return True


def check_resources(config: JobConfig, workers: int) -> None:
    import ray

    resources = ray.cluster_resources()
    if config.device == "cuda":
        have, need, what = resources.get("GPU", 0), workers, "GPU"
    else:
        have, need, what = resources.get("CPU", 0), workers * config.cpus_per_worker, "CPU"
    if have < need:
        raise ExtractError(
            f"the Ray cluster has {have:g} {what}(s); {workers} worker(s) need {need} -- lower --workers"
        )


class WorkerPool:
    """The actors, one `ExtractionWorker` each. Replaces dead actors on request."""

    def __init__(self, config: JobConfig, plan, layer_ids: list[int]):
        import ray

        from .worker import ExtractionWorker

        if config.device == "cuda":
            options = dict(num_gpus=1, num_cpus=config.cpus_per_worker)
        else:
            options = dict(num_cpus=config.cpus_per_worker)
        self._remote = ray.remote(max_concurrency=2, max_restarts=0, **options)(ExtractionWorker)
        self._args = (
            str(Path(config.model).resolve()),
            plan.settings["tokenizer_path"],
            str(Path(config.store).resolve()),
            list(layer_ids),
            plan.settings,
        )
        self._kwargs = dict(
            device=config.device,
            topk=config.target_topk,
            store_dtype=config.store_dtype,
            batch_tokens=config.batch_tokens,
            torch_threads=config.cpus_per_worker if config.device == "cpu" else None,
            trust_remote_code=config.trust_remote_code,
        )
        self._faults = config.faults
        self.created = 0  # actors spawned, replacements of dead ones included
        self.actors: list = []
        self.infos: list[WorkerInfo] = []  # what each first actor loaded (`start`)
        self.startup_seconds = 0.0

    def spawn(self):
        kill = self._faults.actor_kill_after(self.created)
        self.created += 1
        return self._remote.remote(*self._args, **self._kwargs, kill_after_batches=kill)

    def start(self, count: int) -> None:
        """Start `count` actors; each loads the target once and says what it loaded
        (`infos`). All must run the same kernels: a store comes from one implementation."""
        import ray

        started = time.perf_counter()
        self.actors = [self.spawn() for _ in range(count)]
        try:
            self.infos = ray.get([actor.info.remote() for actor in self.actors])
        except ray.exceptions.RayActorError as error:
            raise ExtractError(f"a worker failed to start (loading the target): {cause(error)}") from None
        self.startup_seconds = time.perf_counter() - started
        kernels = sorted({json.dumps(info.kernels, sort_keys=True) for info in self.infos})
        if len(kernels) > 1:
            raise ExtractError(
                f"workers run different kernels ({kernels}); a store must come from one "
                "implementation -- install the same extras on every node"
            )

    def replace(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self.spawn()

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []


@contextmanager
def started_workers(config: JobConfig, plan, layer_ids: list[int], count: int) -> Iterator[WorkerPool]:
    """`count` started actors on Ray (started here unless it runs already or the job
    joins a cluster); the actors, and a Ray started here, are shut down on exit."""
    import ray

    started_ray = start_ray(config)
    pool = None
    try:
        check_resources(config, count)
        pool = WorkerPool(config, plan, layer_ids)
        pool.start(count)
        yield pool
    finally:
        if pool is not None:
            pool.shutdown()
        if started_ray:
            ray.shutdown()


def cause(error: BaseException) -> str:
    """One readable line: Ray's actor-death messages run to a paragraph."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines()) or type(error).__name__
    for marker in ("The actor is dead because", "The actor died because"):
        if marker in text:
            text = text[text.index(marker):]
    for cut in (" Some common causes", " The actor never ran"):
        text = text.split(cut)[0]
    return text[:300]


def _worker_died_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    kinds = [rex.RayActorError, rex.WorkerCrashedError]
    for name in ("OutOfMemoryError", "NodeDiedError", "ActorUnavailableError"):
        if hasattr(rex, name):
            kinds.append(getattr(rex, name))
    return tuple(kinds)


# --------------------------------------------------------------------------- messages


def failure_message(failure: ShardFailed, store_path: Path) -> str:
    shard, kind, message = failure.shard, failure.kind, failure.message
    if kind == "disk_full":
        return disk_full_message(store_path, f"while writing {shard}") + f" ({message})"
    if kind == "corpus_changed":
        return f"shard {shard}: {message} -- the corpus or tokenizer changed since the plan was made; use --overwrite"
    if kind == "device_oom":
        return f"shard {shard}: the device ran out of memory ({message}); lower --batch-tokens and rerun"
    return f"shard {shard} failed on {failure.host}: {message}\n{failure.traceback}".rstrip()


# --------------------------------------------------------------------------- the queue


@dataclass
class DispatchCounts:
    """What the dispatch did, for the job's report."""

    shards_written: int = 0
    samples_written: int = 0
    tokens_written: int = 0
    bytes_written: int = 0  # on disk, of the shards this job's workers replied for
    raw_bytes_written: int = 0
    shards_committed_elsewhere: int = 0
    shards_retried: int = 0
    shards_committed_before_worker_death: int = 0
    worker_deaths: int = 0


class Dispatcher:
    """The queue of pending shards, what each actor holds (in flight), tries per
    shard, and the counts. `run` keeps every actor busy until the queue is empty."""

    def __init__(
        self,
        pool: WorkerPool,
        plan,
        pending: list[str],
        store_path: Path,
        *,
        max_attempts: int,
        inflight_per_worker: int,
        kill_driver_after_shards: int | None = None,
        progress: bool = False,
        log: Callable[[str], None] = print,
    ):
        self.pool = pool
        self.store_path = Path(store_path)
        self.queue: deque[str] = deque(pending)
        self.inflight: dict = {}  # ObjectRef -> (actor index, shard name)
        self.attempts: Counter = Counter()
        self.counts = DispatchCounts()
        self.max_attempts = max_attempts
        self.inflight_per_worker = inflight_per_worker
        self.kill_driver_after_shards = kill_driver_after_shards
        self.progress = progress
        self.log = log
        self._sizes = {s.name: (len(s.samples), s.num_tokens) for s in plan.shards}  # samples, tokens
        self._total_samples = plan.num_samples
        self._pending = len(pending)
        self._replies = 0

    def run(self) -> DispatchCounts:
        import ray

        died = _worker_died_errors()
        bar = self._bar()
        started = time.perf_counter()
        try:
            self._fill()
            while self.inflight:
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=1.0)
                for ref in ready:
                    if ref not in self.inflight:
                        continue  # dropped with its dead actor
                    index, name = self.inflight.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except died as error:
                        for shard in self.worker_died(error, index, name):
                            bar.update(self._sizes[shard][0])
                        continue
                    if isinstance(reply, ShardFailed):
                        raise ExtractError(failure_message(reply, self.store_path))
                    self._done(reply)
                    bar.update(self._sizes[name][0])
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix(
                        tok_s=f"{self.counts.tokens_written / elapsed:.0f}",
                        MB_s=f"{self.counts.bytes_written / elapsed / 1e6:.2f}",
                        shards=f"{self._replies}/{self._pending}",
                        refresh=False,
                    )
                self._fill()
        finally:
            bar.close()
        return self.counts

    def _load(self, index: int) -> int:
        return sum(1 for i, _ in self.inflight.values() if i == index)

    def _fill(self) -> None:
        for index, actor in enumerate(self.pool.actors):
            while self.queue and self._load(index) < self.inflight_per_worker:
                name = self.queue.popleft()
                self.attempts[name] += 1
                self.inflight[actor.extract_shard.remote(name)] = (index, name)

    def _done(self, reply: ShardDone) -> None:
        self._replies += 1
        counts = self.counts
        if not reply.written:
            counts.shards_committed_elsewhere += 1
            return
        self._count_written(reply.shard)
        counts.bytes_written += reply.disk_bytes
        counts.raw_bytes_written += reply.raw_bytes
        kill = self.kill_driver_after_shards
        if kill is not None and counts.shards_written >= kill:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: the driver dies here

    def _count_written(self, shard: str) -> None:
        samples, tokens = self._sizes[shard]
        self.counts.shards_written += 1
        self.counts.samples_written += samples
        self.counts.tokens_written += tokens

    def worker_died(self, error: BaseException, index: int, name: str) -> list[str]:
        """Actor `index` died holding `name` (and whatever else it had in flight): put
        its uncommitted shards back at the front of the queue and replace it. Returns
        the shards whose commit landed before it died (the rename is the commit, so a
        dead writer's shard is either whole or absent): counted as written, never
        recomputed."""
        from store_schema import layout
        from store_schema.writer import remove_staging

        held = [name] + [n for i, n in self.inflight.values() if i == index]
        self.inflight = {ref: held_by for ref, held_by in self.inflight.items() if held_by[0] != index}
        self.counts.worker_deaths += 1
        landed = [shard for shard in held if layout.is_committed(self.store_path, shard)]
        lost = [shard for shard in held if shard not in landed]
        self.counts.shards_committed_before_worker_death += len(landed)
        for shard in landed:
            self._count_written(shard)
        for shard in lost:
            if self.attempts[shard] >= self.max_attempts:
                raise ExtractError(
                    f"shard {shard} failed {self.attempts[shard]} time(s): its worker died each time "
                    f"(last: {cause(error)}); the job stops -- committed shards are kept, rerun to resume"
                )
            remove_staging(self.store_path, shard)  # no live writer holds it now
            self.counts.shards_retried += 1
        self.queue.extendleft(reversed(lost))
        kept = f" ({', '.join(landed)} committed before it died)" if landed else ""
        redo = ", ".join(lost) or "nothing"
        self.log(f"worker {index} died ({cause(error)}); redoing {redo} on a fresh worker{kept}")
        self.pool.replace(index)
        return landed

    def _bar(self):
        from tqdm import tqdm

        queued = set(self.queue)
        done = sum(samples for name, (samples, _) in self._sizes.items() if name not in queued)
        return tqdm(
            total=self._total_samples,
            initial=done,
            unit="sample",
            desc="extract",
            disable=not self.progress,
            mininterval=1.0,
            smoothing=0.1,
            file=sys.stderr,
        )
