"""Ray start-up and the actor pool: long-lived workers built from one job's spec,
one per GPU or CPU slot, started (or replaced) and shut down with the job.

`ray` is imported where it is used: planning and `--help` import the job modules
without loading Ray (seconds) or starting it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from store_schema.runtime.cli import terminate_as_interrupt
from store_schema.runtime.host import available_cores

from ..errors import ExtractError, actor_error_cause
from .protocol import BatchFaults, WorkerInfo
from .settings import Placement, joins_cluster
from .starting import StartingActors


def start_ray(placement) -> bool:
    """Connect to Ray. Returns True if this call started it (and must shut it down)."""
    import ray  # Ray only where a job runs on it (gpu_check's workers run without)

    if ray.is_initialized():
        return False
    # Ray announces on stderr that token authentication (its secure default) is on: not news for a job's log.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if joins_cluster(placement.address):
        # a running cluster (or `ray job submit`)
        ray.init(address=placement.address, log_to_driver=True, logging_level=logging.WARNING)
    else:
        needed = placement.workers * placement.cpus_per_worker if placement.device == "cpu" else placement.workers
        ray.init(
            address="local",
            num_cpus=max(available_cores(), needed),
            include_dashboard=False,  # no dashboard / job server for a local run
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
    terminate_as_interrupt()  # Ray's driver installed its own SIGTERM handler (a stack dump): Ctrl-C's again
    return True


def check_resources(placement, workers: int) -> None:
    """Refuse a cluster too small for `workers`, with advice the command line accepts."""
    import ray  # Ray only where a job runs on it (gpu_check's workers run without)

    resources = ray.cluster_resources()
    if placement.device == "cuda":
        have, per_worker, what = resources.get("GPU", 0), 1, "GPU"
    else:
        have, per_worker, what = resources.get("CPU", 0), placement.cpus_per_worker, "CPU"
    if have >= workers * per_worker:
        return
    fits = int(have // per_worker)
    if fits >= 1:
        advice = f"pass --workers {fits}" + (" (or fewer --cpus-per-worker)" if what == "CPU" else "")
    elif what == "GPU":
        advice = "use --device cpu, or join a cluster with GPUs (--address)"
    else:
        advice = f"lower --cpus-per-worker to {int(have)} or join a bigger cluster (--address)"
    raise ExtractError(
        f"the Ray cluster has {have:g} {what}(s); {workers} worker(s) need {workers * per_worker} -- {advice}"
    )


class ActorPool:
    """Long-lived actors built from one worker spec (`extract.extraction.worker.ExtractionSpec`,
    `extract.generate.worker.GenerationSpec`, ...: a frozen dataclass naming its
    ``actor_class()``, ``task`` and ``groups_in_flight``), one per GPU (``num_gpus=1``) or per CPU slot, each
    running ``task(shard names, attempts) -> GroupDone`` for the `Dispatcher`.
    Replaces dead actors on request."""

    def __init__(self, placement: Placement, spec):
        import ray  # Ray only where a job runs on it (gpu_check's workers run without)

        gpus = 1 if placement.device == "cuda" else 0
        # Group tasks held at once: the spec's (extraction: two, one computes while the other writes).
        self.groups_in_flight = spec.groups_in_flight
        self._remote = ray.remote(spec.actor_class()).options(
            max_concurrency=self.groups_in_flight, max_restarts=0, num_gpus=gpus, num_cpus=placement.cpus_per_worker
        )
        self.spec, self.task = spec, spec.task
        self._faults = placement.faults
        self.created = 0  # actors spawned, replacements of dead ones included
        self.actors: list = []
        self.infos: list[WorkerInfo] = []  # what each first actor loaded (`start`)
        self.starting = StartingActors()  # replacements still loading the target
        self.startup_seconds = 0.0

    def spawn(self):
        number = self.created
        self.created += 1
        faults = BatchFaults(
            self._faults.actor_kill_after(number), self._faults.actor_stop_after(number), self._faults.oom_over_tokens
        )
        return self._remote.remote(self.spec, faults)

    def start(self, count: int, log=None, interval: float = 30.0) -> None:
        """Start `count` actors; each loads the target once and says what it loaded
        (`infos`), its ready time logged as it comes (loading a 27B target takes
        minutes). All must run the same kernels: a store comes from one implementation."""
        import ray  # Ray only where a job runs on it (gpu_check's workers run without)

        log = log or (lambda message: None)
        started = time.perf_counter()
        self.actors = [self.spawn() for _ in range(count)]
        log(f"loading the target on {count} worker(s)...")
        waiting = {actor.info.remote(): index for index, actor in enumerate(self.actors)}
        infos: dict[int, WorkerInfo] = {}
        try:
            while waiting:
                ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(interval, 1.0))
                elapsed = time.perf_counter() - started
                if not ready:
                    log(f"loading the target: {len(infos)} of {count} worker(s) ready after {elapsed:.0f} s")
                for ref in ready:
                    index = waiting.pop(ref)
                    info = infos[index] = ray.get(ref)
                    log(
                        f"worker {index} ready after {elapsed:.1f} s ({info.device} on {info.host}, "
                        f"{info.startup_seconds:.1f} s loading)"
                    )
        except ray.exceptions.RayActorError as error:
            raise ExtractError(f"a worker failed to start (loading the target): {actor_error_cause(error)}") from None
        except KeyboardInterrupt:
            raise
        except Exception as error:
            raise ExtractError(f"a worker failed to start: {actor_error_cause(error)}") from None
        self.infos = [infos[index] for index in range(count)]
        self.startup_seconds = time.perf_counter() - started
        kernels = sorted({json.dumps(info.kernels, sort_keys=True) for info in self.infos})
        if len(kernels) > 1:
            raise ExtractError(
                f"workers run different kernels ({kernels}); a store must come from one "
                "implementation -- install the same extras on every node"
            )

    def ask_first(self, method: str, *args):
        """The first actor's answer to `method(*args)`: a job's one question before its
        shards are dispatched (a projection's second moments); its failure is the job's."""
        import ray  # Ray only where a job runs on it (gpu_check's workers run without)

        try:
            return ray.get(getattr(self.actors[0], method).remote(*args))
        except ray.exceptions.RayError as error:
            raise ExtractError(f"a worker failed answering {method}: {actor_error_cause(error)}") from None

    def replace(self, index: int) -> None:
        import ray  # Ray only where a job runs on it (gpu_check's workers run without)

        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self.spawn()
        self.starting.add(index, self.actors[index].info.remote())

    def shutdown(self) -> None:
        import ray  # Ray only where a job runs on it (gpu_check's workers run without)

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []


@contextmanager
def started_workers(placement: Placement, spec, count: int, log=None, interval: float = 30.0) -> Iterator[ActorPool]:
    """`count` started actors built from `spec`, on Ray (started here unless it runs
    already or the job joins a cluster); the actors, and a Ray started here, are shut
    down on exit."""
    import ray  # Ray only where a job runs on it (gpu_check's workers run without)

    started_ray = start_ray(placement)
    pool = None
    try:
        check_resources(placement, count)
        pool = ActorPool(placement, spec)
        pool.start(count, log, interval)
        yield pool
    finally:
        if pool is not None:
            pool.shutdown()
        if started_ray:
            ray.shutdown()
