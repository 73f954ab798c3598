"""The training rate `extract plan --cache-size` sizes a store's traffic at: what
`python -m train fit --dry-run` computes for the default drafter on the same GPUs (its
FLOPs per sample over the GPU's peak x MFU), so the job has one pace, not three.

The trainer owns that arithmetic and `extract` never imports `train`: the rate is read
from the trainer's own command, its JSON line, in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from store_schema.runtime.cli import UsageError


@dataclass(frozen=True)
class TrainingRate:
    tokens_per_s: float  # the whole job's
    rule: str  # where it comes from, as the dry run prints it


def stated_rate(tokens_per_s: float) -> TrainingRate:
    return TrainingRate(tokens_per_s, "--train-tokens-per-s")


def dry_run_rate(model: str, gpus: int, gpu_tflops: float | None, mfu: float, max_length: int) -> TrainingRate:
    """The default drafter's training tokens/s on `gpus` GPUs, by `train fit --dry-run`."""
    if gpu_tflops is None:
        raise UsageError(
            "--cache-size needs the training rate: --train-tokens-per-s N, or --gpu-tflops TFLOPS for the "
            "rate `python -m train fit --dry-run` computes for the default drafter"
        )
    with tempfile.TemporaryDirectory(prefix="plan-rate-") as scratch:
        command = [
            sys.executable,
            "-m",
            "train",
            "fit",
            "--dry-run",
            "--target",
            str(model),
            "--out",
            str(Path(scratch) / "run"),
            "--nproc",
            str(gpus),
            "--samples",
            "1",
            "--gpu-tflops",
            str(gpu_tflops),
            "--mfu",
            str(mfu),
            "--set",
            f"data.max_length={max_length}",
        ]
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(
            f"--cache-size: `train fit --dry-run` gave no training rate ({why}); pass --train-tokens-per-s"
        )
    report = json.loads(lines[-1])
    per_gpu = float(report["tokens_per_s"])
    return TrainingRate(
        per_gpu * gpus,
        f"`train fit --dry-run` for the default {report['architecture']} drafter: {gpus} GPU(s) x "
        f"{per_gpu:,.0f} tokens/s ({report['tokens_per_s_rule']})",
    )
