"""Every benchmark's `--smoke` runs here as a user would run it (a child process, the
JSON line it prints last checked for the keys it promises), so no benchmark can rot
between the runs that measure with it (`extract_bench --quick` once crashed on main
unnoticed). A smoke run never writes benchmarks/RESULTS.md. gpu_check's smoke has its
own test (tests/test_gpu_check.py); store, extract, train and drafter run through run_all."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import served

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
RUN_SECONDS = 1700  # inside the slow tests' pytest-timeout


def run_all_module():
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# script -> the keys its last JSON line promises (its docstring's figures)
SMOKE_KEYS = {
    "attention_bench.py": {"attention_speedup_min", "attention_speedup_max", "sizes", "threads", "rounds"},
    "codebook_optim_bench.py": {"adamw_fused_step_s", "sparse_adam_step_s", "adamw_fused_state_bytes",
                                "distinct_rows", "quick_loss_rows"},
    "fp8_parity.py": {"tau_bf16", "tau_fp8", "tau_ratio", "bytes_ratio", "fp8_bytes_ratio", "heldout_samples"},
    "generate_bench.py": {"openai_vs_plain_client", "openai_tokens_per_s", "plain_client_tokens_per_s",
                          "hf_tokens_per_s", "server"},
    # the GOALS table's figures of store, extract and train, and extract's padding and planning
    "run_all.py": {f"{bench}.{key}" for bench, key, _, _ in run_all_module().GOALS}
                  | {"extract.padded_token_ratio", "extract.plan_records_per_s", "drafter.variants", "drafter.goal_met",
                     "drafter.offline_tau_dflash_decay", "drafter.decode_tau_dflash2_warm"},
}


def smoke(script: str, *args: str, env: dict | None = None) -> dict:
    """Run `benchmarks/<script> --smoke`; its last stdout line as JSON, RESULTS.md untouched."""
    results = (BENCHMARKS / "RESULTS.md").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=RUN_SECONDS)
    assert done.returncode == 0, f"{script} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{script} --smoke printed nothing"
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), f"{script} --smoke: the last line is not one JSON object: {lines[-1][:200]}"
    assert (BENCHMARKS / "RESULTS.md").read_bytes() == results, f"{script} --smoke wrote benchmarks/RESULTS.md"
    return figures


def test_every_benchmark_script_has_a_smoke_test():
    scripts = {path.name for path in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in path.read_text()}
    covered = set(SMOKE_KEYS) | {f"{name}_bench.py" for name in run_all_module().BENCHMARKS} | {"gpu_check.py"}
    assert scripts == covered, f"benchmarks without a smoke test: {sorted(scripts - covered)}"


@pytest.mark.slow  # child processes
def test_attention_bench_smoke():
    figures = smoke("attention_bench.py")
    assert SMOKE_KEYS["attention_bench.py"] <= set(figures) and figures["smoke"] is True
    assert figures["sizes"][0]["max_abs_diff"] < 1e-4  # split and dense SDPA agree


@pytest.mark.slow  # child processes
def test_run_all_smoke_runs_store_extract_and_train():
    figures = smoke("run_all.py")
    missing = SMOKE_KEYS["run_all.py"] - set(figures)
    assert not missing, f"run_all --smoke lacks {sorted(missing)}"
    assert all(figures[f"{name}.smoke"] is True for name in run_all_module().BENCHMARKS)
    assert figures["extract.tokens"] > 0 and 1.0 <= figures["extract.padded_token_ratio"] < 2.0
    variants = figures["drafter.variants"]  # DFlash / DFlash 2, each decoded losslessly
    assert set(variants) == {"dflash_decay", "dflash2_warm"}  # drafter_bench.SMOKE_VARIANTS
    assert all(v["lossless"] and v["decode_tau"] >= 1.0 for v in variants.values())
    assert variants["dflash2_warm"]["parameters"] > variants["dflash_decay"]["parameters"]
    assert variants["dflash2_warm"]["heldout_selector_acc"] is not None  # the selector trained and was measured
    assert figures["store.shard_cache_fill_mb_s"] > 0 and figures["store.shard_cache_read_ratio_vs_local"] > 0
    assert figures["store.uploader_mb_s"] > 0
    assert 0 <= figures["store.trainer_data_wait_share_cache"] <= 1
    assert 0 <= figures["store.trainer_data_wait_share_local"] <= 1
    assert figures["store.trainer_fit"]["cache"]["shards_fetched"] == 0  # the measured fit read a warm cache


@pytest.mark.slow  # child processes
def test_fp8_parity_smoke(tmp_path):
    figures = smoke("fp8_parity.py", "--workdir", str(tmp_path))
    assert SMOKE_KEYS["fp8_parity.py"] <= set(figures) and figures["smoke"] is True
    assert figures["heldout_samples"] > 0 and 0 < figures["fp8_bytes_ratio"] < figures["bytes_ratio"]


@pytest.mark.slow  # child processes
def test_generate_bench_smoke():
    figures = smoke("generate_bench.py", env={"DFLASH_VLLM_PYTHON": served.vllm_python()})
    assert SMOKE_KEYS["generate_bench.py"] <= set(figures) and figures["smoke"] is True
    assert figures["openai_tokens_per_s"] > 0 and figures["hf_tokens_per_s"] > 0


@pytest.mark.slow  # a child process
def test_codebook_optim_bench_smoke():
    figures = smoke("codebook_optim_bench.py")
    assert SMOKE_KEYS["codebook_optim_bench.py"] <= set(figures)
