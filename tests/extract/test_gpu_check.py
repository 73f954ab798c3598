"""`python benchmarks/gpu_check.py --smoke` runs on CPU (issue 27.6): the GPU check
cannot rot between GPU sessions. Every phase runs; on CPU the fla / causal-conv1d
comparisons and flex's gradients are skipped with their reason, the fallbacks run.

It runs as the device would run it (issue 60.1, tests/device_guard.py): every package
outside the device image and the wheels `benchmarks/device_wheels.py` reads from
pyproject.toml is not importable (Ray among them), so an import the device lacks fails
here. Each phase prints its own JSON line as it ends, and the verdict comes last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import REPO

pytestmark = pytest.mark.slow  # child processes


def gpu_check(tmp_path, *flags) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """gpu_check.py --smoke as the device runs it; its JSON lines."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = [str(REPO / "tests" / "device_guard.py"), str(REPO / "benchmarks" / "gpu_check.py")]
    done = subprocess.run(
        [sys.executable, *script, "--smoke", "--workdir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    return done, [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]


def test_gpu_check_smoke_runs_every_phase_on_cpu(tmp_path):
    done, lines = gpu_check(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "device_guard: blocked ray" in done.stderr  # Ray is installed here, and not on the device
    *phases, figures = lines
    names = [
        "environment",
        "kernels",
        "attention",
        "ddp",
        "build",
        "extract",
        "extract_fp8",
        "loader",
        "train",
        "train_dflash2",
        "speculate",
        "eval",
        "serve_check",
    ]
    assert [line["phase"] for line in phases] == names
    assert all(line["ok"] and line["error"] is None for line in phases), phases
    # on CPU: fla, causal-conv1d, flex grads; vLLM is not in the device's environment
    assert figures["verdict"] == "PARTIAL" and not figures["failed"]
    assert len(figures["skipped"]) == 4 and all(": " in reason for reason in figures["skipped"])
    assert "serve_check: vLLM does not import here" in figures["skipped"]
    assert set(figures["seconds"]) == set(figures["peak_gpu_gb"]) == set(names)
    kernels, attention = figures["kernels_check"], figures["attention_check"]
    assert kernels["linear_attention_fallback_vs_recurrent"]["cosine"] >= 0.9999
    assert "linear_attention_fla_vs_fallback" in kernels or kernels["linear_attention_fla"].startswith("skipped: ")
    assert attention["flex_vs_split"]["max_abs_diff"] < 1e-4
    assert figures["tokens"] > 0 and figures["extract_tokens_per_s"] > 0 and figures["forward_only_tokens_per_s"] > 0
    assert figures["forward_bytes_per_token"] is None  # the forward's memory per token: CUDA's counters only
    assert figures["loader_samples"] > 0 and figures["train_vocab"] == 248_320 and figures["train_loss_finite"]
    assert figures["train_steps_timed"] == 2  # 4 steps, the first two (compilation) left out
    assert figures["train_compiled_graphs"] == 0  # the split path on CPU: nothing compiled
    # DFlash 2 (issue 32.9): its steps at the real vocabulary, selector loss and metrics included
    assert figures["train_dflash2_vocab"] == 248_320 and figures["train_dflash2_loss_finite"]
    assert figures["train_dflash2_steps_timed"] == 2 and figures["train_dflash2_tokens_per_s"] > 0
    assert figures["train_dflash2_parameters"] > 2 * 248_320 * 32  # the two codebooks and more
    assert 0.0 <= figures["train_dflash2_selector_acc"] <= figures["train_dflash2_recall_at_k"] <= 1.0
    # issue 60.1: DDP as fit builds it, fp8 with top-k, and the trained drafters decoding for real
    assert figures["ddp_check"]["grads_vs_bare"]["cosine"] >= 0.999 and figures["ddp_allreduce"] == "fp32"
    assert figures["fp8_tokens"] == figures["tokens"]
    assert figures["fp8_store_bytes_ratio"] < figures["store_bytes_ratio"]
    for kind in ("dflash", "dflash_rerun", "dflash2"):
        decoded = figures["speculate_check"][kind]
        assert decoded["passed"] and decoded["lossless_prompts"] == decoded["prompts"] == 2, decoded
        assert decoded["dtype"] == "float32" and decoded["tau"] >= 1
    assert figures["speculate_check"]["dflash_rerun"]["rollback"] == "rerun"  # issue 60.6: both ways, measured
    assert figures["eval_tau"] >= 1 and figures["eval_samples"] >= 1
    assert not list(tmp_path.iterdir())  # the work directory is removed


def test_chosen_phases_run_with_what_they_need_and_a_failure_is_reported_not_raised(tmp_path):
    done, lines = gpu_check(tmp_path, "--phases", "loader")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line["phase"] for line in lines[:-1]] == ["build", "extract", "loader"]
    assert "environment: not chosen (--phases)" in lines[-1]["skipped"]
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check as check

    figures, done_phases = {}, {}
    check.run_phase("build", lambda: 1 / 0, figures, "cpu", done_phases)
    check.run_phase("extract", dict, figures, "cpu", done_phases)
    check.run_phase(
        "kernels",
        lambda: {"kernels_check": {"linear_attention_fallback_vs_recurrent": {"cosine": 0.9}}},
        figures,
        "cpu",
        done_phases,
    )
    result = check.verdict(figures, list(check.PHASES))
    assert result["verdict"] == "FAIL"
    assert result["failed"] == {
        "build": "ZeroDivisionError: division by zero",
        "extract": "needs the build phase, which did not pass",
        "kernels": "linear_attention_fallback_vs_recurrent cosine 0.9 < 0.9999",
    }


def test_the_device_wheels_are_pyprojects_dependencies_less_the_image_and_the_host_only():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import device_wheels

    carried = {device_wheels.name_of(r) for r in device_wheels.carried()}
    declared = {device_wheels.name_of(r) for r in device_wheels.declared()}
    assert {"zarr", "zstandard", "google_crc32c", "flash_linear_attention"} <= carried <= declared
    assert not carried & {"ray", "torch", "transformers", "causal_conv1d"}
    assert (
        declared - carried
        == {
            device_wheels.name_of(n)
            for n in (*device_wheels.DEVICE_IMAGE, *device_wheels.NOT_ON_DEVICE, *device_wheels.NO_WHEEL)
        }
        & declared
    )
