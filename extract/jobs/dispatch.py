"""The driver's queue of shards: it hands them out to the actor pool
(`extract.jobs.pool`) and takes replies in (`Dispatcher`).

The unit of work is a group of ``batch_shards`` consecutive shards of the plan
(`extract.jobs.batching.batch_groups`), batched together on one worker. Every actor
holds at most two groups (one on the device while the other is written; an engine
that only waits on servers, more: `ActorPool.groups_in_flight`) and gets
the next one when one finishes, so fast workers take more. Each shard handed out is
a numbered attempt of this run (`store_schema.commit.lock.ShardFence`). An actor whose
process dies, or that holds work and replies nothing for ``worker_timeout`` seconds
(hung, or on a node cut off from the driver but perhaps still writing), is *lost*:
each attempt it held is revoked -- it can never commit, whatever its process does
later -- its groups go back to the front of the queue (a commit that landed before
is counted, never redone), and the actor is replaced; a replacement gets work once
it has started (`extract.jobs.starting`). A shard gets at most ``max_attempts`` tries.
Any failure a worker reports (`ShardFailed`) stops the job with a message that says
what to do."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from store_schema.runtime.progress import Progress
from store_schema.stores import backend

from ..errors import ExtractError, actor_error_cause, disk_full_message
from .batching import batch_groups
from .pool import ActorPool
from .protocol import ShardDone, ShardFailed
from .settings import DispatchSettings

# `ray` is imported where it is used: the job's report reads this module's counts
# without loading Ray (seconds) or starting it.


def _worker_died_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex  # Ray only where a job runs on it (gpu_check's workers run without)

    kinds = [rex.RayActorError, rex.WorkerCrashedError]
    for name in ("OutOfMemoryError", "NodeDiedError", "ActorUnavailableError"):
        if hasattr(rex, name):
            kinds.append(getattr(rex, name))
    return tuple(kinds)


# --------------------------------------------------------------------------- messages


def failure_message(failure: ShardFailed, store_path) -> str:
    shard, kind, message = failure.shard, failure.kind, failure.message
    if kind == "disk_full":
        return disk_full_message(store_path, f"while writing {shard}") + f" ({message})"
    if kind == "corpus_changed":
        return f"shard {shard}: {message} -- the corpus or tokenizer changed since the plan was made; use --overwrite"
    if kind == "device_oom":
        return f"shard {shard}: the device ran out of memory ({message}); lower --batch-tokens and rerun"
    if kind == "endpoints_down":
        return (
            f"shard {shard}: {message.split(': ', 1)[-1]} -- the job stops; committed shards and finished "
            f"replies are kept: restart the server(s) and rerun the same command to resume"
        )
    return f"shard {shard} failed on {failure.host}: {message} (the worker's traceback is above)"


# --------------------------------------------------------------------------- the queue


@dataclass
class DispatchCounts:
    """What the dispatch did, for the job's report."""

    shards_written: int = 0
    samples_written: int = 0
    tokens_written: int = 0
    padded_tokens: int = 0  # what the device computed for the written shards' samples
    filler_tokens: int = 0  # committed shards of a group, computed again so its batches stay the same
    bytes_written: int = 0  # on disk, of the shards this job's workers replied for
    raw_bytes_written: int = 0
    shards_committed_elsewhere: int = 0
    shards_retried: int = 0
    shards_committed_before_worker_death: int = 0
    worker_deaths: int = 0
    workers_timed_out: int = 0  # lost by missing their deadline (counted in worker_deaths too)
    attempts_revoked: int = 0
    upload_bytes: int = 0  # sent to object storage by the workers that replied
    upload_seconds: float = 0.0  # summed over the uploads (each worker uploads its own shards)
    spool_wait_seconds: float = 0.0  # summed over the shards: waited for room in a local spool
    shards_by_node: dict = field(default_factory=dict)  # Ray node id -> shards its workers wrote and replied for


@dataclass(frozen=True)
class _Held:
    """One group in flight: which actor holds it, the attempts it may commit, and
    when it was handed out."""

    index: int
    group: tuple[str, ...]
    attempts: dict  # shard -> store_schema.commit.lock.Attempt, for the shards to write
    since: float


class Dispatcher:
    """The queue of pending groups, what each actor holds (in flight), tries per
    shard, and the counts. `run` keeps every actor busy until the queue is empty."""

    def __init__(
        self,
        pool: ActorPool,
        plan,
        pending: list[str],
        fence,
        settings: DispatchSettings,
        progress: Progress | None = None,
        log: Callable[[str], None] = print,
        output=None,
    ):
        self.pool = pool
        self.fence = fence  # store_schema.commit.lock.ShardFence of this run (objstore.commit.BucketFence)
        self.output = output or backend(fence.store).job_output()
        self.left = set(pending)  # shards neither written nor found committed yet
        groups = batch_groups([s.name for s in plan.shards], settings.batch_shards)
        self.queue: deque[tuple[str, ...]] = deque(g for g in groups if self.left.intersection(g))
        self.inflight: dict = {}  # ObjectRef -> _Held
        self.attempts: Counter = Counter()
        self.counts = DispatchCounts()
        self.max_attempts = settings.max_attempts
        self.worker_timeout = settings.worker_timeout
        self.kill_driver_after_shards = settings.kill_driver_after_shards
        self.progress = progress or Progress("extract", 0, "sample")
        self.log = log
        self._sizes = {s.name: (len(s.samples), s.num_tokens) for s in plan.shards}  # samples, tokens
        self._pending = len(pending)
        self._replies = 0
        self._last_reply: dict[int, float] = {}  # actor index -> when it last replied

    def run(self) -> DispatchCounts:
        import ray  # Ray only where a job runs on it (gpu_check's workers run without)

        died = _worker_died_errors()
        try:
            self._fill()
            while self.inflight or self.queue:
                if not self.inflight:  # every actor lost, no replacement started yet
                    self.pool.starting.wait(self.worker_timeout, len(self.left))
                    self._fill()
                    continue
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=1.0)
                for ref in ready:
                    held = self.inflight.get(ref)
                    if held is None:
                        continue  # dropped with its lost actor
                    self._last_reply[held.index] = time.monotonic()
                    try:
                        reply = ray.get(ref)
                    except died as error:
                        self.worker_died(error, held.index)
                        continue
                    del self.inflight[ref]
                    self.counts.filler_tokens += reply.filler_tokens
                    for shard_reply in reply.replies:
                        if isinstance(shard_reply, ShardFailed):
                            if shard_reply.kind == "error" and shard_reply.traceback:
                                self.log(
                                    f"worker traceback ({shard_reply.shard} on {shard_reply.host}):\n"
                                    f"{shard_reply.traceback.rstrip()}"
                                )
                            raise ExtractError(failure_message(shard_reply, self.output.where))
                        self._done(shard_reply)
                self._check_deadlines()
                self.pool.starting.poll()
                self._fill()
                self.progress.tick()
        finally:
            self.progress.close()
        return self.counts

    def _load(self, index: int) -> int:
        return sum(1 for held in self.inflight.values() if held.index == index)

    def _fill(self) -> None:
        for index, actor in enumerate(self.pool.actors):
            while self.queue and self._load(index) < self.pool.groups_in_flight and self.pool.starting.ready(index):
                group = self.queue.popleft()
                attempts = {}
                for name in group:
                    if name in self.left:
                        self.attempts[name] += 1
                        attempts[name] = self.fence.attempt(self.attempts[name])
                ref = getattr(actor, self.pool.task).remote(list(group), attempts)
                self.inflight[ref] = _Held(index, group, attempts, time.monotonic())

    def _done(self, reply: ShardDone) -> None:
        self._replies += 1
        self.left.discard(reply.shard)
        counts = self.counts
        if reply.written:
            self._count_written(reply.shard)
            counts.shards_by_node[reply.node] = counts.shards_by_node.get(reply.node, 0) + 1
            counts.bytes_written += reply.disk_bytes
            counts.raw_bytes_written += reply.raw_bytes
            counts.padded_tokens += reply.padded_tokens
            counts.upload_bytes += reply.upload_bytes
            counts.upload_seconds += reply.upload_seconds
            counts.spool_wait_seconds += reply.spool_wait_seconds
        else:
            counts.shards_committed_elsewhere += 1
        samples, tokens = self._sizes[reply.shard]
        self.progress.update(samples, reply.tokens if reply.written else 0, shards=f"{self._replies}/{self._pending}")
        kill = self.kill_driver_after_shards
        if kill is not None and counts.shards_written >= kill:
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: the driver dies here

    def _count_written(self, shard: str) -> None:
        samples, tokens = self._sizes[shard]
        self.counts.shards_written += 1
        self.counts.samples_written += samples
        self.counts.tokens_written += tokens

    def _check_deadlines(self) -> None:
        """An actor that holds work and has replied nothing for `worker_timeout`
        seconds (since its last reply, or since it was handed its oldest group) is lost."""
        now = time.monotonic()
        for index in sorted({held.index for held in self.inflight.values()}):
            oldest = min(held.since for held in self.inflight.values() if held.index == index)
            quiet_since = max(oldest, self._last_reply.get(index, oldest))
            if now - quiet_since > self.worker_timeout:
                self.counts.workers_timed_out += 1
                self._lose(
                    index,
                    f"no reply for {now - quiet_since:.0f} s (--worker-timeout "
                    f"{self.worker_timeout:g}): hung or cut off",
                )

    def worker_died(self, error: BaseException, index: int) -> list[str]:
        """Actor `index`'s process died (a task of it raised Ray's death error): `_lose`."""
        return self._lose(index, f"died: {actor_error_cause(error)}")

    def _lose(self, index: int, why: str) -> list[str]:
        """Stop trusting actor `index`: revoke every attempt it holds, so none of them
        can commit from now on whatever its process does (the driver's view wins), put
        its groups back at the front of the queue and replace it. Returns the shards
        whose commit landed before (the rename is the commit, so a lost writer's
        shard is either whole or absent): counted as written, never redone. A revoked
        attempt's staging files are removed; an attempt that had already claimed its
        commit keeps them (its rename may still land)."""
        held = [h for h in self.inflight.values() if h.index == index]
        self.inflight = {ref: h for ref, h in self.inflight.items() if h.index != index}
        self.counts.worker_deaths += 1
        landed, lost = [], []
        for shard, attempt in ((s, a) for h in held for s, a in h.attempts.items()):
            revoked = self.fence.revoke(shard, attempt)
            self.counts.attempts_revoked += revoked
            if self.output.is_committed(shard):
                landed.append(shard)
                continue
            if self.attempts[shard] >= self.max_attempts:
                raise ExtractError(
                    f"shard {shard} failed {self.attempts[shard]} time(s): its worker was lost each time "
                    f"(last: {why}); the job stops -- committed shards are kept, rerun to resume"
                )
            if revoked:
                self.output.remove_attempt(shard, attempt)
            lost.append(shard)
            self.counts.shards_retried += 1
        self.counts.shards_committed_before_worker_death += len(landed)
        for shard in landed:
            self.left.discard(shard)
            self._count_written(shard)
            self.progress.update(self._sizes[shard][0])
        self.queue.extendleft(reversed([h.group for h in held if self.left.intersection(h.group)]))
        kept = f" ({', '.join(landed)} committed before)" if landed else ""
        self.log(
            f"worker {index} lost ({why}); its attempts are revoked; redoing {', '.join(lost) or 'nothing'} "
            f"on a fresh worker{kept}"
        )
        self.pool.replace(index)
        self._last_reply.pop(index, None)
        return landed
