"""`python -m train fit` as a person or a job runner sees it (issue 16 items 2, 4, 10):
without a terminal it prints progress lines (step, samples, tokens/s, ETA); Ctrl-C
checkpoints the last completed step, prints one line saying how to resume, exits 130
with no traceback; `--resume` then says where it continues in words and goes on
exactly as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import builders
import pytest
import tiny
from paths import REPO

from train.cli import main
from train.fitting.checkpoint import latest_checkpoint

# A drafter small enough for CPU, a constant LR (so a resumed run may end at another
# --max-steps and still take the same steps), epochs enough to outlast the test.
SETS = tiny.drafter_sets(
    "model.num_anchors=16",
    "train.grad_accumulation=1",
    "train.log_every=1",
    "eval.every=0",
    "train.checkpoint_every=0",
    "optim.schedule=constant",
    "optim.warmup_fraction=0",
    "train.epochs=10000",
    "train.progress_interval=0",
    heads=True,
)
PROGRESS = re.compile(
    r"^fit: ([\d,]+)/([\d,]+) steps \(\d+\.\d%\), ([\d,]+) samples, [\d,]+ tokens/s, .*"
    r"ETA (unknown|\d+:\d\d:\d\d)$"
)
COMPARED_STEPS = 12


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("interrupt") / "store"
    builders.random_store(path, num_shards=3, samples_per_shard=4, num_target_layers=6, hidden_size=64, vocab_size=512)
    return path


def fit_argv(store, target, out, max_steps: int) -> list[str]:
    return [
        "fit",
        "--store",
        str(store),
        "--target",
        str(target),
        "--out",
        str(out),
        "--max-steps",
        str(max_steps),
        *tiny.cli_sets(SETS),
    ]


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a child process
def test_sigterm_is_ctrl_c_a_checkpoint_and_the_resume_line(store, qwen3_dir, tmp_path):
    """Issue 62.7: SIGTERM (Slurm preemption, Kubernetes eviction, `timeout`) checkpoints
    and says how to resume, as Ctrl-C does: no silent exit 143 losing the steps since the
    last periodic checkpoint."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def ready(line: str) -> bool:
        match = PROGRESS.match(line)
        return bool(match) and int(match.group(1).replace(",", "")) >= 2

    command = [sys.executable, "-m", "train", *fit_argv(store, qwen3_dir, run, 100_000)]
    returncode, err, _ = builders.ctrl_c_when(command, env, ready, terminate=True)
    assert returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    checkpoint = latest_checkpoint(run)
    assert checkpoint is not None and err.strip().splitlines()[-1] == (
        f"interrupted: checkpoint of step {int(checkpoint.name.split('-')[1])} saved in {checkpoint}; "
        f"resume with: python -m train fit --out {run} --resume"
    )


@pytest.mark.slow  # child processes
def test_ctrl_c_checkpoints_says_how_to_resume_and_resume_is_exact(store, qwen3_dir, tmp_path):
    reference = tmp_path / "reference"
    assert main(fit_argv(store, qwen3_dir, reference, COMPARED_STEPS)) == 0

    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def ready(line: str) -> bool:  # stderr is a pipe: progress comes as lines, one per step at interval 0
        match = PROGRESS.match(line)
        return bool(match) and int(match.group(1).replace(",", "")) >= 2

    returncode, err, _ = builders.ctrl_c_when(
        [sys.executable, "-m", "train", *fit_argv(store, qwen3_dir, run, 100_000)], env, ready
    )
    assert returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    progress = [PROGRESS.match(line) for line in err.splitlines() if PROGRESS.match(line)]
    assert [int(m.group(3).replace(",", "")) for m in progress] == [int(m.group(1)) for m in progress]  # 1 per step
    checkpoint = latest_checkpoint(run)
    step = int(checkpoint.name.split("-")[1])
    assert err.strip().splitlines()[-1] == (
        f"interrupted: checkpoint of step {step} saved in {checkpoint}; "
        f"resume with: python -m train fit --out {run} --resume"
    )
    assert [r["step"] for r in read_log(run)] == list(range(1, step + 1))
    if step >= COMPARED_STEPS:
        pytest.skip(f"Ctrl-C landed after step {step}")

    resumed = subprocess.run(
        [sys.executable, "-m", "train", "fit", "--out", str(run), "--resume", "--max-steps", str(COMPARED_STEPS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"fit: resumed from {checkpoint} at step {step} ({step:,} samples trained on), epoch " in resumed.stderr, (
        resumed.stderr[-3000:]
    )
    assert "LoaderPosition(" not in resumed.stderr
    expected, got = read_log(reference), read_log(run)
    assert [r["step"] for r in got] == list(range(1, COMPARED_STEPS + 1))
    for a, b in zip(expected, got):  # the interrupted step was not half-applied: the same steps follow
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, (a, b)


def test_resume_without_a_checkpoint_is_a_missing_path(tmp_path, capsys):
    """What an interrupted first demo left behind (a run directory with config.yaml and
    no checkpoint) and a run directory that does not exist: exit 2, one line."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("train:\n  seed: 0\n")
    for out in (tmp_path / "run", tmp_path / "missing"):
        assert main(["fit", "--out", str(out), "--resume"]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(f"error: --resume: no checkpoint in {out / 'checkpoints'}")
