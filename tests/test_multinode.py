"""More than one node, rehearsed on one host:

- `train fit --nnodes 2 --node-rank 0|1 --master-addr 127.0.0.1` (two node
  processes, one rank each, gloo over loopback) trains the same steps with the
  same losses as `fit --nproc 2` on one node with the same config."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import builders
from test_distributed import fit_args, steps_of
from train.fitting.runlog import read_log

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ONE_EPOCH = ("train.epochs=1",)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fit_command(store: Path, target: Path, out: Path, *launch: str) -> list[str]:
    return [sys.executable, "-m", "train", "fit", *fit_args(store, target, out, *ONE_EPOCH), *launch]


def test_two_nodes_train_the_steps_and_losses_of_two_processes_on_one(qwen3_dir, tmp_path):
    store = tmp_path / "store"
    builders.random_store(store, num_shards=7, samples_per_shard=5, num_target_layers=6, layer_ids=(1, 3))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    one_node = subprocess.run(fit_command(store, qwen3_dir, tmp_path / "one-node", "--nproc", "2"), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    two_nodes, port = tmp_path / "two-nodes", str(free_port())
    nodes = [subprocess.Popen(fit_command(store, qwen3_dir, two_nodes, "--nproc", "1", "--nnodes", "2",
                                          "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                                          "--master-port", port),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=600) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    assert "2 process(es), 2 lane(s)" in outputs[0][1]

    got, expected = read_log(two_nodes), read_log(tmp_path / "one-node")
    assert len(got) == len(expected) > 3 and all(row["world_size"] == 2 for row in got)
    for a, b in zip(got, expected):
        assert (a["step"], a["epoch"], a["lr"]) == (b["step"], b["epoch"], b["lr"])
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)  # bit-identical
    assert steps_of(two_nodes) == steps_of(tmp_path / "one-node")


def test_a_node_rank_outside_the_nodes_is_refused(qwen3_dir, tmp_path):
    store = tmp_path / "store"
    builders.random_store(store, num_shards=2, samples_per_shard=2, num_target_layers=6, layer_ids=(1, 3))
    refused = subprocess.run(fit_command(store, qwen3_dir, tmp_path / "run", "--nnodes", "2", "--node-rank", "2"),
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert refused.returncode != 0 and "--node-rank 2 is outside 0..1 (--nnodes 2)" in refused.stderr
