"""`verify --ray ADDRESS|auto`: a store's shards checked across a Ray cluster's nodes.

The driver (the `verify` command) lists the shards as a local verify does and deals
them round-robin, in batches, to the cluster's live nodes that have CPUs; each batch
is a Ray task on its node (a soft affinity: a task whose node is lost is run again by
Ray on another node, up to `RETRIES` times). Every node must reach the store at the
same location: a filesystem path they all mount, or an s3:// / gs:// URL. The
results come back per shard and are merged by the driver exactly as a local verify
merges its threads' (sample ids across shards, the store-wide layer medians, the
plan's missing shards). A batch whose task failed for good comes back shard by shard
through `on_failure`: nothing is called intact that no node read.

`STALL_DIR_ENV` is a test hook: a task on node N first touches ``started-N`` in that
directory, then waits while ``stall-N`` exists there (how the tests lose a node
while it holds work)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

RETRIES = 3  # runs of a batch beyond the first when its node or worker is lost
BATCHES_PER_NODE = 4  # a lost node's share is spread this thin; results stream back batch by batch
STALL_DIR_ENV = "DFLASH_VERIFY_STALL_DIR"


def cluster_results(
    location: str,
    names: list[str],
    check_batch: Callable,
    batch_args: Callable[[list[str]], tuple],
    address: str,
    on_failure: Callable[[str, str], object],
    retries: int | None = None,
) -> Iterator:
    """`check_batch(location, batch, *batch_args(batch))`'s results (one per shard, in
    `names` order), each batch run as a task on one of the cluster's nodes at
    `address` ("auto": the cluster this machine belongs to); for a batch whose task
    failed for good, `on_failure(name, error)` of each of its shards."""
    import ray  # Ray only for `verify --ray`
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # Ray only for `verify --ray`

    started = _connect(address)
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
        if not nodes:
            raise ValueError(f"the Ray cluster at {address!r} has no live node with CPUs to verify on")
        batches = _batches(names, len(nodes) * BATCHES_PER_NODE)
        retries = RETRIES if retries is None else retries
        task = ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=False)(_run_batch)
        refs = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=True)).remote(
                check_batch, location, batch, *batch_args(batch)
            )
            for i, batch in enumerate(batches)
        ]
        for batch, ref in zip(batches, refs):
            try:
                results = ray.get(ref)
            except ray.exceptions.RayError as exc:
                results = [on_failure(name, _first_line(exc)) for name in batch]
            yield from results
    finally:
        if started:
            ray.shutdown()


def _connect(address: str) -> bool:
    """Join the cluster; True if this call connected (and must disconnect)."""
    import ray  # Ray only for `verify --ray`

    if ray.is_initialized():
        return False
    # Ray announces on stderr that token authentication (its secure default) is on: not news for a report.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    return True


def _batches(names: list[str], count: int) -> list[list[str]]:
    """`names` in at most `count` consecutive batches of near-equal size."""
    size = max(1, -(-len(names) // max(1, count)))
    return [names[i : i + size] for i in range(0, len(names), size)]


def _run_batch(check_batch: Callable, location: str, batch: list[str], *args) -> list:
    """A cluster task: one batch checked on this node, each result stamped with the node's id."""
    import ray  # Ray only for `verify --ray`

    node = ray.get_runtime_context().get_node_id()
    _stall_if_asked(node)
    results = check_batch(location, batch, *args)
    for result in results:
        result.node = node
    return results


def _stall_if_asked(node: str) -> None:
    folder = os.environ.get(STALL_DIR_ENV)
    if not folder:
        return
    Path(folder, f"started-{node}").touch()
    while Path(folder, f"stall-{node}").exists():
        time.sleep(0.05)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
