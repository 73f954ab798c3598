"""Shared by the extraction tests on a real local Ray cluster (tests/extract/test_extract_job.py
and the fault suite, tests/test_faults_*.py): the module-scoped cluster fixture, the
job config, a store's content as bytes, the `extract run` command line, and waits
for the processes a killed driver leaves behind.

tests/conftest.py registers this module as a plugin (`pytest_plugins`), so a test asks
for `ray_cluster` as for any fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import REPO

SHARD_TOKENS = 1500
BATCH_TOKENS = 1200
LAYERS = [1, 3, 5]
WORKER_PROCESS = "ray::ExtractionWorker"  # the title Ray gives an extraction actor's process


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster per test module (2 CPUs, no dashboard); its GCS address."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def execution_of(overrides: dict, **defaults):
    """The `Execution` fields among a test's keyword overrides, popped into one
    `extract.jobs.settings.Execution` over `defaults`."""
    from dataclasses import fields

    from extract.jobs.settings import Execution

    names = {field.name for field in fields(Execution)}
    return Execution(**{**defaults, **{name: overrides.pop(name) for name in list(overrides) if name in names}})


def job_config(model, corpus_path, store, *, shard_tokens=SHARD_TOKENS, **overrides):
    """An `extract run` config for the tiny targets: 2 CPU workers unless `overrides` say
    otherwise (Execution's fields and JobConfig's alike)."""
    from extract.extraction.config import JobConfig
    from store_schema.plan import PlanSettings

    settings = dict(
        model=str(model),
        corpus=str(corpus_path),
        store=str(store),
        layers=list(LAYERS),
        plan_settings=PlanSettings(shard_tokens=shard_tokens),
        batch_tokens=BATCH_TOKENS,
        execution=execution_of(overrides, workers=2, device="cpu"),
    )
    settings.update(overrides)
    return JobConfig(**settings)


def extract_command(
    model,
    corpus_path,
    store,
    address: str,
    *,
    layers=LAYERS,
    shard_tokens=SHARD_TOKENS,
    batch_tokens=BATCH_TOKENS,
    workers: int = 1,
    extra=(),
) -> list[str]:
    """The `python -m extract run` command line of a job joining the cluster at `address`."""
    return [
        sys.executable,
        "-m",
        "extract",
        "run",
        "--model",
        str(model),
        "--corpus",
        str(corpus_path),
        "--store",
        str(store),
        "--layers",
        ",".join(map(str, layers)),
        "--shard-tokens",
        str(shard_tokens),
        "--batch-tokens",
        str(batch_tokens),
        "--workers",
        str(workers),
        "--address",
        address,
        "--no-progress",
        *extra,
    ]


def store_content(store) -> dict:
    """Everything a store holds, by shard and sample id, as raw bytes."""
    from store_schema import Store

    reader = Store(store)
    content = {}
    for name in reader.committed_shards():
        data = reader.read_shard(name)
        for i in range(len(data)):
            s = data.sample(i)
            content[(name, s.sample_id)] = (
                s.input_ids.numpy().tobytes(),
                s.loss_mask.numpy().tobytes(),
                {L: h.view(torch.int16).numpy().tobytes() for L, h in s.hidden.items()},
            )
    return content


def verify_cli(store) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "store_schema", "verify", str(store), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def committed_inodes(store) -> dict:
    """Committed shard -> its directory's inode (a recomputed, re-committed shard gets a new one)."""
    shards = Path(store) / "shards"
    if not shards.is_dir():
        return {}
    return {p.name: p.stat().st_ino for p in shards.iterdir() if (p / "commit.json").is_file()}


def worker_pids() -> list[int]:
    """Live extraction actor processes on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(WORKER_PROCESS):
            pids.append(int(entry.name))
    return pids


def wait_for_no_workers(deadline_polls: int = 600) -> None:
    """After a driver is killed, Ray kills the actors it owned; wait until they are
    gone, so that none of them commits a shard behind the next job's back. A poll
    count bounds the wait (a hang guard, not a timing assertion)."""
    import time

    for _ in range(deadline_polls):
        if not worker_pids():
            return
        time.sleep(0.1)
    raise AssertionError(f"extraction actors still alive after their driver died: {worker_pids()}")


def kill(pid: int, signal_number) -> None:
    try:
        os.kill(pid, signal_number)
    except ProcessLookupError:
        pass
