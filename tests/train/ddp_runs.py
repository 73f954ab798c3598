"""The data-parallel runs' shared recipe and what they are compared by: the sample
ids each step trained on, over every rank's samples log."""

from __future__ import annotations

import json
from pathlib import Path

import tiny

HELDOUT = 0.25
SETS = tiny.drafter_sets(
    "model.num_anchors=16",
    f"data.heldout_fraction={HELDOUT}",
    "data.buffer_shards=2",
    "optim.lr=1e-2",
    "train.batch_size=2",
    "train.grad_accumulation=2",
    "train.epochs=3",
    "train.log_every=1",
    "eval.every=10",
    "eval.samples=4",
    "eval.max_blocks_per_sample=16",
    "eval.ddtree_budgets=[8]",
    "train.checkpoint_every=4",
    "train.keep_checkpoints=0",
    "log.samples=true",
    heads=True,
)


def fit_args(store: Path, target: Path, out: Path, *sets: str) -> list[str]:
    return ["--store", str(store), "--target", str(target), "--out", str(out), *tiny.cli_sets((*SETS, *sets))]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_of(run: Path) -> dict[int, list[str]]:
    """Sample ids trained at each step, over every rank."""
    by_step: dict[int, list[str]] = {}
    for path in sorted((run / "samples").glob("rank-*.jsonl")):
        for row in read_jsonl(path):
            by_step.setdefault(row["step"], []).append(row["sample_id"])
    return {step: sorted(ids) for step, ids in sorted(by_step.items())}
