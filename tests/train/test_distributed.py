"""Data-parallel `train fit` on CPU with gloo, in real processes (torchrun's
launcher through `fit --nproc 2`, and `python -m torch.distributed.run`):

- a 2-rank run and a 1-rank run with the same seed, global batch and lanes train
  on the same samples at every step and log the same losses (20+ steps, across a
  rank killed with SIGKILL and the job resumed with the same command);
- over the 2-rank run, every training sample of a store with an odd shard count
  is trained on exactly once per epoch, held-out ones never;
- a killed rank ends the job within 60 s with one error line and the last
  checkpoint intact; resuming continues exactly (same world size), and a 1-rank
  resume of the 2-rank run continues on the same samples.
Few process launches: one killed 2-rank job and its resume; the rest in-process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import builders
import pytest
from ddp_runs import HELDOUT, fit_args, read_jsonl, steps_of
from paths import REPO

from store_schema import Store
from train.cli import main
from train.config_error import ConfigError
from train.data.heldout import is_heldout
from train.data.lanes import check_world
from train.fitting.checkpoint import list_checkpoints, load_model_weights, read_state
from train.fitting.runlog import read_log

STEPS = 23  # 3 epochs of the store's training samples, 4 per step, the fuller lane's tail padded


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """7 shards (odd: the two lanes get 4 and 3, dealt once for the run) of 5 samples."""
    path = tmp_path_factory.mktemp("ddp") / "store"
    builders.random_store(path, num_shards=7, samples_per_shard=5, num_target_layers=6, layer_ids=(1, 3))
    return path


def truncated_copy(run: Path, to: Path, step: int) -> Path:
    """`run` as it stood when checkpoint `step` was its newest."""
    shutil.copytree(run, to)
    for path in list_checkpoints(to):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    return to


def assert_same_curve(got: Path, expected: Path, rel: float) -> None:
    a, b = read_log(got), read_log(expected)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=rel) and x["grad_norm"] == pytest.approx(
            y["grad_norm"], rel=rel
        )
        assert x["epoch"] == y["epoch"] and x["lr"] == y["lr"]
        assert ("heldout_loss" in x) == (x["step"] in (10, 20, STEPS)) == ("heldout_loss" in y)  # rank 0 evaluates
        if "heldout_loss" in x:
            assert x["heldout_loss"] == pytest.approx(y["heldout_loss"], rel=rel) and x["heldout_samples"] == 4
    assert steps_of(got) == steps_of(expected)


@pytest.fixture(scope="module")
def one_rank(store, qwen3_dir, tmp_path_factory) -> Path:
    """The 1-rank reference: the same two lanes, in one process."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["fit", *fit_args(store, qwen3_dir, out, "data.lanes=2")]) == 0
    return out


@pytest.mark.slow  # two fits and a resume: ~25 s
def test_one_rank_over_two_lanes_resumes_exactly(one_rank, tmp_path):
    rows = read_log(one_rank)
    assert len(rows) == STEPS and all(r["world_size"] == 1 for r in rows)
    cut = truncated_copy(one_rank, tmp_path / "cut", 8)
    assert main(["fit", "--out", str(cut), "--resume"]) == 0
    assert_same_curve(cut, one_rank, rel=1e-9)
    lanes = read_state(list_checkpoints(cut)[-1])["loader"]["lanes"]
    assert [(entry["lane"], entry["epoch"]) for entry in lanes] == [(0, 3), (1, 3)]  # both lanes ran dry


@pytest.mark.slow  # a 23-step run and its resume: ~20 s
def test_a_dflash2_run_resumes_exactly(store, qwen3_dir, tmp_path, monkeypatch):
    """DFlash 2 drifted from its uninterrupted run at ~1e-7 from the first steps after a
    resume (and between two runs): its codebooks were read as `codebook[ids]`, whose
    backward adds float rows from two threads in an order that changes run to run.
    So on two threads (the suite runs one per process: tests/conftest.py)."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # `fit` sets torch's threads from it
    threads = torch.get_num_threads()
    try:
        run = tmp_path / "run"
        assert main(["fit", *fit_args(store, qwen3_dir, run, "data.lanes=2", "model.architecture=dflash2")]) == 0
        assert torch.get_num_threads() == 2
        cut = truncated_copy(run, tmp_path / "cut", 8)
        assert main(["fit", "--out", str(cut), "--resume"]) == 0
        assert_same_curve(cut, run, rel=1e-9)
    finally:
        torch.set_num_threads(threads)


def rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of worker `rank` of a job started by `launcher`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            parents = [
                int(line.split()[1]) for line in (entry / "status").read_text().splitlines() if line.startswith("PPid:")
            ]
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID=fit" in env and parents == [launcher.pid]:
            return int(entry.name)
    return None


@pytest.mark.slow  # child processes
def test_two_ranks_follow_one_rank_survive_a_killed_rank_and_cover_every_sample_once_per_epoch(
    store, qwen3_dir, one_rank, tmp_path
):
    out = tmp_path / "two"
    command = fit_args(store, qwen3_dir, out, "log.tensorboard=true")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(
        [sys.executable, "-m", "train", "fit", *command, "--nproc", "2"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = out / "checkpoints" / "step-00000004"
    deadline = time.monotonic() + 240
    while not first.is_dir() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim = rank_pid(job, 1)
    assert victim is not None and job.poll() is None, "the job ended before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = job.communicate(timeout=120)
    assert time.monotonic() - killed < 60
    assert job.returncode == 1
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith(f"error: fit on 2 processes stopped: rank 1 (pid {victim}) killed by SIGKILL"), errors
    latest = list_checkpoints(out)[-1]
    assert f"the last checkpoint is {latest}" in errors[0] and "--resume" in errors[0]
    assert int(latest.name.split("-")[1]) < STEPS
    state = read_state(latest)  # intact: its JSON and weights read back
    assert load_model_weights(latest) and state["loader"]["world_size"] == 2
    assert [entry["rank"] for entry in state["loader"]["lanes"]] == [0, 1]

    # The same command with --resume, through torchrun itself this time.
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "-m",
            "train",
            "fit",
            *command,
            "--resume",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Warning" not in resumed.stderr, resumed.stderr[-3000:]  # e.g. torch's broadcast_buffers deprecation
    assert_same_curve(out, one_rank, rel=1e-4)
    rows = read_log(out)
    assert all(r["world_size"] == 2 for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tb"))
    board.Reload()  # the killed run's events past its checkpoint were purged by the resumed one
    losses = {event.step: event.value for event in board.Scalars("loss")}
    assert [event.step for event in board.Scalars("loss")] == sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[r["step"]] == pytest.approx(r["loss"], rel=1e-6) for r in rows)
    assert "per_position_acc/1" in board.Tags()["scalars"]

    # Every training sample once per epoch across the ranks; rank r trained only its lanes.
    ids = {
        s.sample_id
        for data in Store(store).iter_shards(Store(store).committed_shards(), layers=[])
        for s in (data.sample(i) for i in range(len(data)))
    }
    training = {i for i in ids if not is_heldout(i, HELDOUT)}
    assert 0 < len(training) < len(ids)
    trained = [
        row for rank in (0, 1) for row in read_jsonl(out / "samples" / f"rank-{rank}.jsonl") if row["lane"] % 2 == rank
    ]
    assert len(trained) == sum(len(read_jsonl(p)) for p in (out / "samples").glob("rank-*.jsonl"))
    for epoch in range(3):
        assert Counter(r["sample_id"] for r in trained if r["epoch"] == epoch) == Counter(training), epoch
    per_step = Counter(r["step"] for r in trained)
    assert sum(per_step.values()) == 3 * len(training) and min(per_step.values()) < 4  # a lane ran dry first

    # A 1-rank resume of the 2-rank run's checkpoint 8: the two lanes carry on in one process.
    single = truncated_copy(out, tmp_path / "single", 8)
    shutil.rmtree(single / "samples")
    shutil.copytree(one_rank / "samples", single / "samples")  # the 1-rank run's record up to step 8, one file
    assert main(["fit", "--out", str(single), "--resume"]) == 0
    assert_same_curve(single, one_rank, rel=1e-4)


def test_world_sizes_that_cannot_share_the_lanes_are_refused():
    check_world(2, 8, 8, resumed=True)
    with pytest.raises(ConfigError, match=r"global batch .* 8 sequences .* multiple of the number of processes"):
        check_world(3, 3, 8, resumed=False)
    with pytest.raises(ConfigError, match=r"dealt into data.lanes=4 sample streams when it started.*use 1 or 2 or 4"):
        check_world(8, 4, 8, resumed=True)
