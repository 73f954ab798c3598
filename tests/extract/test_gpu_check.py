"""`python benchmarks/gpu_check.py --smoke` runs on CPU (issue 27.6): the GPU check
cannot rot between GPU sessions. Every phase runs; on CPU the fla / causal-conv1d
comparisons and flex's gradients are skipped with their reason, the fallbacks run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import REPO

pytestmark = pytest.mark.slow  # child processes


def test_gpu_check_smoke_runs_every_phase_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert (
        set(figures["seconds"])
        == set(figures["peak_gpu_gb"])
        == {"kernels", "attention", "build", "extract", "loader", "train", "train_dflash2"}
    )
    kernels, attention = figures["kernels_check"], figures["attention_check"]
    assert kernels["linear_attention_fallback_vs_recurrent"]["cosine"] >= 0.9999
    assert "linear_attention_fla_vs_fallback" in kernels or kernels["linear_attention_fla"].startswith("skipped: ")
    assert attention["flex_vs_split"]["max_abs_diff"] < 1e-4
    assert figures["tokens"] > 0 and figures["extract_tokens_per_s"] > 0 and figures["forward_only_tokens_per_s"] > 0
    assert figures["loader_samples"] > 0 and figures["train_vocab"] == 248_320 and figures["train_loss_finite"]
    assert figures["train_steps_timed"] == 2  # 4 steps, the first two (compilation) left out
    assert figures["train_compiled_graphs"] == 0  # the split path on CPU: nothing compiled
    # DFlash 2 (issue 32.9): its steps at the real vocabulary, selector loss and metrics included
    assert figures["train_dflash2_vocab"] == 248_320 and figures["train_dflash2_loss_finite"]
    assert figures["train_dflash2_steps_timed"] == 2 and figures["train_dflash2_tokens_per_s"] > 0
    assert figures["train_dflash2_parameters"] > 2 * 248_320 * 32  # the two codebooks and more
    assert 0.0 <= figures["train_dflash2_selector_acc"] <= figures["train_dflash2_recall_at_k"] <= 1.0
    assert not list(tmp_path.iterdir())  # the work directory is removed
