"""Fault suite, mismatch: `python -m train fit` against a target whose hidden size,
vocabulary or layer count differs from the store's fingerprint exits non-zero with a
one-line error naming the field (and starts no training)."""

from __future__ import annotations

import subprocess
import sys

import builders
import pytest
import tiny
from paths import REPO

pytestmark = [pytest.mark.faults, pytest.mark.slow]  # fault injection

# The tiny Qwen3 target (qwen3_dir): 6 layers, hidden 64, vocabulary 512.
MATCHING = dict(num_target_layers=6, hidden_size=64, vocab_size=512)


def fit(store, target, out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "fit",
            "--store",
            str(store),
            "--target",
            str(target),
            "--out",
            str(out),
            "--max-steps",
            "1",
            *tiny.cli_sets(tiny.drafter_sets("eval.every=0")),
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("field,value", [("hidden_size", 32), ("vocab_size", 1024), ("num_target_layers", 8)])
def test_fit_cli_refuses_a_store_from_another_target(qwen3_dir, tmp_path, field, value):
    builders.random_store(tmp_path / "store", num_shards=1, samples_per_shard=2, **{**MATCHING, field: value})
    result = fit(tmp_path / "store", qwen3_dir, tmp_path / "run")
    assert result.returncode == 1, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: store fingerprint does not match") and f"{field}: store has {value}" in error
    assert "Traceback" not in result.stderr  # a refusal, not a crash
    assert not (tmp_path / "run" / "train_log.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()
