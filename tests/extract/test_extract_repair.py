"""Issue 26's extraction findings that need real workers, on one small local Ray
cluster shared by the module (kept to three jobs: Ray is the slow part).

- 26.3: `verify --repair` + the same `extract run` gives a byte-identical store; a
  shard directory without its commit record is handled by `extract run` itself.
- 26.6: Ctrl-C while the workers load the target keeps the store and its plan, and
  the rerun does not plan again.
- 26.6: the advice for a cluster too small is a value the command line accepts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from builders import coding_chats, ctrl_c_when, write_chat_jsonl
from ray_helpers import REPO, extract_command, job_config

pytestmark = pytest.mark.slow  # a Ray cluster

SHARD_TOKENS = 600


def _files(store: Path) -> dict[str, bytes]:
    """Every committed shard file, by path, as bytes."""
    shards = store / "shards"
    return {str(p.relative_to(shards)): p.read_bytes() for p in sorted(shards.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_chat_jsonl(tmp_path_factory.mktemp("corpus") / "chats.jsonl", coding_chats(24, seed=3))


@pytest.fixture(scope="module")
def reference(ray_cluster, qwen3_5_dir, corpus, tmp_path_factory):
    from extract.extraction.job import run_job

    store = tmp_path_factory.mktemp("ref") / "store"
    messages = []
    report = run_job(
        job_config(qwen3_5_dir, corpus, store, shard_tokens=SHARD_TOKENS, workers=1, address=ray_cluster),
        log=messages.append,
    )
    assert report["status"] == "complete" and report["shards"] >= 4, report
    return store, report, messages


def test_worker_start_says_what_it_loads_and_when_each_worker_is_ready(reference):
    _, _, messages = reference
    assert "loading the target on 1 worker(s)..." in messages, messages
    assert any(m.startswith("worker 0 ready after ") and " s loading)" in m for m in messages), messages


def test_repair_then_rerun_gives_a_byte_identical_store(reference, ray_cluster, qwen3_5_dir, corpus, tmp_path, capsys):
    """One shard with a flipped byte goes aside through `verify --repair`; a second
    one that lost its commit record after the repair is set aside by `extract run`
    itself (no `Directory not empty`); the run re-extracts exactly those two, the
    store is byte-identical to the original and `damaged/` is gone once complete."""
    from extract.extraction.job import run_job
    from store_schema.__main__ import main as store_main

    original, first, _ = reference
    store = tmp_path / "store"
    shutil.copytree(original, store)
    names = sorted(p.name for p in (store / "shards").iterdir() if p.is_dir())
    damaged, commitless = names[1], names[-1]
    layer = next(p for p in (store / "shards" / damaged / "layer_3" / "c").rglob("*") if p.is_file())
    data = bytearray(layer.read_bytes())
    data[len(data) // 3] ^= 0x55
    layer.write_bytes(bytes(data))
    assert store_main(["verify", str(store), "--repair"]) == 3  # damage moved aside: intact, incomplete
    assert f"moved 1 damaged shard(s) to {store}/damaged/: {damaged}" in capsys.readouterr().out
    (store / "shards" / commitless / "commit.json").unlink()

    messages = []
    report = run_job(
        job_config(qwen3_5_dir, corpus, store, shard_tokens=SHARD_TOKENS, workers=1, address=ray_cluster),
        log=messages.append,
    )
    assert report["status"] == "complete" and report["plan_reused"], report
    assert report["shards_written"] == 2 and report["shards_skipped"] == first["shards"] - 2, report
    assert any(f"without a commit record to damaged/ ({commitless})" in m for m in messages), messages
    assert _files(store) == _files(original)
    assert not (store / "damaged").exists()
    assert store_main(["verify", str(store)]) == 0


def test_ctrl_c_while_workers_load_keeps_the_plan_and_the_rerun_does_not_replan(ray_cluster, qwen3_5_dir, tmp_path):
    from store_schema.plan_io import read_committed_plan

    corpus = write_chat_jsonl(tmp_path / "chats.jsonl", coding_chats(8, seed=5))
    store = tmp_path / "store"
    command = extract_command(qwen3_5_dir, corpus, store, ray_cluster, shard_tokens=SHARD_TOKENS)
    command[command.index("--no-progress")] = "--progress-interval"
    command.insert(command.index("--progress-interval") + 1, "0.01")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    returncode, err, _ = ctrl_c_when(command, env, lambda line: line == "loading the target on 1 worker(s)...")
    assert returncode == 130, err[-3000:]
    assert "planning:" in err and "the plan and committed shards are kept" in err.splitlines()[-1], err[-3000:]
    plan = read_committed_plan(store)
    assert plan is not None and plan.shards, "the plan went with the interrupted job"

    finished = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "reusing the store's plan" in finished.stderr and "planning:" not in finished.stderr, finished.stderr
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    assert report["plan_reused"] and report["plan_digest"] == plan.digest() and report["status"] == "complete"


def test_a_cluster_too_small_is_answered_with_a_flag_value_the_cli_accepts(ray_cluster):
    from extract.errors import ExtractError
    from extract.jobs.pool import check_resources
    from extract.jobs.settings import FaultInjection, Placement

    cpu = Placement(device="cpu", workers=5, cpus_per_worker=1, address=ray_cluster, faults=FaultInjection())
    with pytest.raises(ExtractError, match=r"has 2 CPU\(s\); 5 worker\(s\) need 5 -- pass --workers 2"):
        check_resources(cpu, 5)
    gpu = Placement(device="cuda", workers=1, cpus_per_worker=1, address=ray_cluster, faults=FaultInjection())
    with pytest.raises(ExtractError, match=r"has 0 GPU\(s\).*-- use --device cpu, or join a cluster with GPUs"):
        check_resources(gpu, 1)
