"""More than one node, rehearsed on one host:

- A Ray cluster of three raylets (`ray.cluster_utils.Cluster`: a head that runs no
  workers and two nodes of one CPU each) runs `python -m extract run --address`
  with a worker on each node; once the first shard is committed one node is
  removed: its shards are redone on the other, the shards committed before are
  untouched (same bytes, same inodes) and `verify` reports the store clean.
- `train fit --nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1` (two node
  processes, one rank each, gloo over loopback) trains the same steps with the
  same losses as `fit --nproc 2` on one node with the same config; from a store in a
  bucket (a loopback moto_server), each node through its own shard cache, which holds
  only the shards of that node's lanes."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import builders
import pytest
from builders import coding_chats, write_chat_jsonl
from ddp_runs import fit_args, steps_of
from paths import REPO
from ray_helpers import committed_inodes, extract_command, verify_cli

from train.fitting.runlog import read_log

pytestmark = pytest.mark.slow

ONE_EPOCH = ("train.epochs=1",)


# Many small shards of one-sample batches: each worker holds work when the node goes.
RECORDS = 40
SHARD_TOKENS = 500
BATCH_TOKENS = 150


@pytest.fixture
def two_node_cluster():
    """A head (no CPUs: the driver's node, no workers) and two one-CPU nodes, each its own raylet."""
    from ray.cluster_utils import Cluster

    # Node deaths are noticed within ~1 s, not Ray's default ~15 s of missed health checks.
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=0,
            include_dashboard=False,
            _system_config={
                "health_check_period_ms": 200,
                "health_check_failure_threshold": 3,
                "health_check_initial_delay_ms": 0,
            },
        ),
    )
    nodes = [cluster.add_node(num_cpus=1, resources={f"node_{name}": 1}) for name in "ab"]
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        cluster.shutdown()


def shard_digests(store: Path, names) -> dict:
    """sha256 of every file of each named committed shard."""
    return {
        name: {
            str(path.relative_to(store)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted((store / "shards" / name).rglob("*"))
            if path.is_file()
        }
        for name in names
    }


def test_extraction_on_two_nodes_survives_losing_one(two_node_cluster, qwen3_5_dir, tmp_path):
    cluster, (kept, lost) = two_node_cluster
    corpus = write_chat_jsonl(tmp_path / "chats.jsonl", coding_chats(RECORDS, seed=5))
    store = tmp_path / "store"
    command = extract_command(
        qwen3_5_dir,
        corpus,
        store,
        cluster.address,
        shard_tokens=SHARD_TOKENS,
        batch_tokens=BATCH_TOKENS,
        workers=2,
        extra=("--batch-shards", "1"),
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    job = subprocess.Popen(
        command,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600  # a hang guard (the first commit takes ~20 s on an idle machine)
        while not committed_inodes(store) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        before = committed_inodes(store)
        if job.poll() is not None:
            ended = f"the job ended (exit {job.returncode}) before a node could be removed"
            pytest.fail(f"{ended}: {job.stderr.read()[-3000:]}")
        assert before, "no shard committed within 600 s: nothing to keep across the node's loss"
        digests = shard_digests(store, before)
        cluster.remove_node(lost, allow_graceful=False)
        stdout, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])  # Ray prints the raylet's death on stdout before it

    assert report["status"] == "complete" and report["shards_committed"] == report["shards"] > len(before)
    assert report["nodes"] == sorted([kept.node_id, lost.node_id])  # a worker started on each node
    by_node = report["shards_by_node"]  # the first commit may have been either node's
    assert by_node.get(kept.node_id, 0) > 0 and set(by_node) <= {kept.node_id, lost.node_id}, by_node
    assert sum(by_node.values()) + report["shards_committed_before_worker_death"] == report["shards_written"]
    # A lost writer that had claimed its commit may still rename after the loss: its retry
    # then finds the shard committed and writes nothing (committed elsewhere).
    assert report["shards_written"] + report["shards_committed_elsewhere"] == report["shards"]
    assert report["shards_committed_elsewhere"] <= report["shards_retried"]  # only a redone shard can find one
    # The lost node's attempts were redone; its replacement had no room on the node left
    # (one CPU, taken), so the node that stayed wrote them. An attempt is revoked unless
    # its writer had already claimed its commit when the node went (then the claim
    # stands and the retry races nothing that can land), so revocations are not counted on.
    assert report["worker_deaths"] == 1 and report["shards_retried"] >= 1
    assert report["attempts_revoked"] <= report["shards_retried"]
    assert report["workers_started"] == 3 and "lost (died" in stderr, stderr[-3000:]
    # Nothing committed before the loss was lost or rewritten.
    assert {name: committed_inodes(store)[name] for name in before} == before
    assert shard_digests(store, before) == digests
    verified = verify_cli(store)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
    assert json.loads(verified.stdout)["ok"] is True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fit_command(store: Path, target: Path, out: Path, *launch: str) -> list[str]:
    return [sys.executable, "-m", "train", "fit", *fit_args(store, target, out, *ONE_EPOCH), *launch]


def run_two_nodes(store, target: Path, out: Path, env: dict, per_node=lambda rank: ()) -> list[str]:
    """`fit --nnodes 2` as two node processes on loopback (one rank each); their stderr."""
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            fit_command(
                store,
                target,
                out,
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                *per_node(rank),
            ),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    return [stderr for _, stderr in outputs]


def test_two_nodes_train_the_steps_and_losses_of_two_processes_on_one(qwen3_dir, tmp_path):
    store = tmp_path / "store"
    builders.random_store(store, num_shards=7, samples_per_shard=5, num_target_layers=6, layer_ids=(1, 3))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    one_node = subprocess.run(
        fit_command(store, qwen3_dir, tmp_path / "one-node", "--nproc", "2"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    two_nodes = tmp_path / "two-nodes"
    outputs = run_two_nodes(store, qwen3_dir, two_nodes, env)
    assert "2 process(es), 2 lane(s)" in outputs[0]

    got, expected = read_log(two_nodes), read_log(tmp_path / "one-node")
    assert len(got) == len(expected) > 3 and all(row["world_size"] == 2 for row in got)
    for a, b in zip(got, expected):
        assert (a["step"], a["epoch"], a["lr"]) == (b["step"], b["epoch"], b["lr"])
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)  # bit-identical
    assert steps_of(two_nodes) == steps_of(tmp_path / "one-node")


def test_two_nodes_train_from_a_bucket_each_through_its_own_cache(url, qwen3_dir, tmp_path):
    """Issue 33.6: one cache per node, each filled with its own lanes' shards only."""
    from store_schema.stores import open_store

    local = tmp_path / "store"
    for where in (url, local):
        builders.random_store(
            where, num_shards=7, samples_per_shard=5, num_target_layers=6, layer_ids=(1, 3), target_dir=qwen3_dir
        )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    one_node = subprocess.run(
        fit_command(local, qwen3_dir, tmp_path / "one-node", "--nproc", "2"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    caches = [tmp_path / f"cache-node{rank}" for rank in (0, 1)]  # each node's local disk
    run_two_nodes(
        url, qwen3_dir, tmp_path / "two-nodes", env, per_node=lambda rank: ("--set", f"data.cache_dir={caches[rank]}")
    )
    got, expected = read_log(tmp_path / "two-nodes"), read_log(tmp_path / "one-node")
    assert len(got) == len(expected) > 3
    assert [(a["step"], a["loss"]) for a in got] == [(b["step"], b["loss"]) for b in expected]  # bit-identical
    cached = [set(open_store(cache).committed_shards()) for cache in caches]
    assert cached[0] and cached[1] and not cached[0] & cached[1]  # each node fetched its own lanes' shards
    assert cached[0] | cached[1] <= set(open_store(url).committed_shards())


def test_a_node_rank_outside_the_nodes_is_refused(qwen3_dir, tmp_path):
    store = tmp_path / "store"
    builders.random_store(store, num_shards=2, samples_per_shard=2, num_target_layers=6, layer_ids=(1, 3))
    refused = subprocess.run(
        fit_command(store, qwen3_dir, tmp_path / "run", "--nnodes", "2", "--node-rank", "2"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert refused.returncode != 0 and "--node-rank 2 is outside 0..1 (--nnodes 2)" in refused.stderr
