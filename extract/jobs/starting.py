"""Replacement actors until they have started: the `extract.jobs.dispatch.Dispatcher`
gives one no work before then. On a cluster that lost a node there may be no room
for a replacement; work handed to it would wait there forever while the actors left
sit idle, so they take the work meanwhile, and with none left the job waits for one
to start for at most ``--worker-timeout``."""

from __future__ import annotations

import time

from ..errors import ExtractError, actor_error_cause


class StartingActors:
    """The replacements still loading the target (or waiting for room), by actor index."""

    def __init__(self):
        self.loading: dict = {}  # the actor's info() ref -> its index in the pool
        self.idle_since: float | None = None  # since when no actor could take queued work

    def add(self, index: int, info_ref) -> None:
        self.loading = {ref: i for ref, i in self.loading.items() if i != index}
        self.loading[info_ref] = index

    def ready(self, index: int) -> bool:
        return index not in self.loading.values()

    def poll(self, timeout: float = 0.0) -> None:
        """Mark the replacements that have started; one that failed to start stops the job."""
        import ray  # here: importing Ray takes seconds; the job's configs read this package without it

        if not self.loading:
            return
        started, _ = ray.wait(list(self.loading), num_returns=len(self.loading), timeout=timeout)
        for ref in started:
            index = self.loading.pop(ref)
            self.idle_since = None
            try:
                ray.get(ref)
            except Exception as error:
                raise ExtractError(
                    f"a replacement for worker {index} failed to start: {actor_error_cause(error)}; "
                    "committed shards are kept, rerun to resume"
                ) from None

    def wait(self, worker_timeout: float, shards_left: int) -> None:
        """Work is queued and no actor is up to take it: wait up to a second for a
        replacement; after `worker_timeout` seconds of this, stop the job."""
        self.idle_since = self.idle_since or time.monotonic()
        waited = time.monotonic() - self.idle_since
        if waited > worker_timeout:
            raise ExtractError(
                f"no worker has been able to start for {waited:.0f} s (--worker-timeout {worker_timeout:g}) with "
                f"{shards_left} shard(s) left: the cluster has no room for a replacement (a node lost?); committed "
                "shards are kept -- add a node or free resources and rerun to resume"
            )
        if not self.loading:
            raise ExtractError(
                f"every worker was lost with {shards_left} shard(s) left and none is starting; "
                "committed shards are kept, rerun to resume"
            )
        self.poll(timeout=1.0)
