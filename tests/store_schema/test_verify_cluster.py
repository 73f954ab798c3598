"""`verify --ray`: a store's shards checked across a Ray cluster's nodes
(`ray.cluster_utils.Cluster`: a head that runs nothing and two one-CPU nodes, each
its own raylet). Both nodes check shards and a damaged one is named as a local
verify names it; a node lost while it holds shards has them checked on the other;
where a lost share cannot be checked again, those shards are reported not checked,
never intact."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from builders import random_store
from paths import REPO

from store_schema.tools.verify import verify_store
from store_schema.tools.verify_cluster import STALL_DIR_ENV
from store_schema.tools.verify_report import NOT_CHECKED, format_report

pytestmark = pytest.mark.slow

SHARDS = 12


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """(cluster, [node a, node b], stall folder): the nodes' workers read the stall hook."""
    from ray.cluster_utils import Cluster

    stall = tmp_path / "stall"
    stall.mkdir()
    monkeypatch.setenv(STALL_DIR_ENV, str(stall))  # inherited by the raylets started below
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
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
    nodes = [cluster.add_node(num_cpus=1) for _ in "ab"]
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes, stall
    finally:
        cluster.shutdown()


def test_verify_ray_shares_the_shards_over_both_nodes_and_names_a_damaged_one(cluster, tmp_path):
    ray_cluster, nodes, _ = cluster
    random_store(tmp_path / "store", num_shards=SHARDS)
    layer = next((tmp_path / "store" / "shards" / "shard-000005").glob("layer_1/c/*/*"))
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "store_schema",
            "verify",
            str(tmp_path / "store"),
            "--ray",
            ray_cluster.address,
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["shards_checked"] == SHARDS
    assert report["shards_by_node"] == {node.node_id: SHARDS // 2 for node in nodes}  # dealt round-robin
    assert [p["shard"] for p in report["problems"]] == ["shard-000005"]
    assert report["problems"][0]["what"].endswith("(bytes changed)")


def _lose_node_when_it_holds_work(ray_cluster, node, stall: Path) -> threading.Thread:
    """Node `node` stalls its first task; once that task started the node is removed."""
    (stall / f"stall-{node.node_id}").touch()

    def lose():
        while not (stall / f"started-{node.node_id}").exists():
            time.sleep(0.05)
        ray_cluster.remove_node(node, allow_graceful=False)

    watcher = threading.Thread(target=lose, daemon=True)
    watcher.start()
    return watcher


def test_a_node_lost_mid_verify_has_its_shards_checked_on_the_other(cluster, tmp_path):
    ray_cluster, (kept, lost), stall = cluster
    random_store(tmp_path / "store", num_shards=SHARDS)
    watcher = _lose_node_when_it_holds_work(ray_cluster, lost, stall)
    report = verify_store(tmp_path / "store", ray_address=ray_cluster.address)
    watcher.join(timeout=60)
    assert report.status == "intact", format_report(report)
    assert report.shards_checked == SHARDS and report.shards_by_node == {kept.node_id: SHARDS}


def test_shards_whose_task_cannot_run_again_are_reported_not_checked(cluster, tmp_path, monkeypatch):
    import store_schema.tools.verify_cluster as verify_cluster

    ray_cluster, (kept, lost), stall = cluster
    random_store(tmp_path / "store", num_shards=SHARDS)
    monkeypatch.setattr(verify_cluster, "RETRIES", 0)
    watcher = _lose_node_when_it_holds_work(ray_cluster, lost, stall)
    report = verify_store(tmp_path / "store", ray_address=ray_cluster.address)
    watcher.join(timeout=60)
    unchecked = [p["shard"] for p in report.problems if p["what"].startswith(NOT_CHECKED.split("(")[0])]
    assert report.status == "damaged" and unchecked, format_report(report)
    assert report.shards_checked == report.shards_by_node[kept.node_id] == SHARDS - len(unchecked)
    assert "run verify again" in format_report(report)
