"""Running a benchmark's `--smoke` as a user would (a child process, its last JSON line)
and the keys each one promises: for the smoke tests of every module that has one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from paths import REPO

BENCHMARKS = REPO / "benchmarks"
RUN_SECONDS = 1700  # inside the slow tests' pytest-timeout


def run_all_module():
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def goal_keys(bench: str, goals=run_all_module().GOALS) -> set[str]:
    """The figures run_all's GOALS table reads from `bench` (unprefixed)."""
    return {key for name, key, _, _ in goals if name == bench}


# script -> the keys its last JSON line promises (its docstring's figures)
SMOKE_KEYS = {
    "attention_bench.py": {"attention_speedup_min", "attention_speedup_max", "sizes", "threads", "rounds"},
    "codebook_optim_bench.py": {
        "adamw_fused_step_s",
        "sparse_adam_step_s",
        "adamw_fused_state_bytes",
        "distinct_rows",
        "quick_loss_rows",
    },
    "scale_bench.py": {
        "start_s_1x",
        "start_s_4x",
        "start_s_16x",
        "verify_first_s_16x",
        "start_ratio_16x_vs_1x",
        "start_s_per_1000_shards",
        "start_s_full_store_projected",
        "local_rerun_s",
        "bucket_rerun_s",
    },
    "layers_bench.py": {"subset_bytes_ratio", "subset_cpu_ratio", "bytes_read", "cpu_seconds", "store_bytes"},
    "fp4_formats.py": {"formats", "chosen"},
    "generate_bench.py": {
        "openai_vs_plain_client",
        "openai_tokens_per_s",
        "plain_client_tokens_per_s",
        "hf_tokens_per_s",
        "server",
    },
    # run_all's benchmarks: the GOALS table's figures, extract's padding and planning, drafter's variants
    "store_bench.py": goal_keys("store"),
    "extract_bench.py": goal_keys("extract") | {"padded_token_ratio", "plan_records_per_s"},
    "train_bench.py": goal_keys("train"),
    "drafter_bench.py": goal_keys("drafter")
    | {"variants", "goal_met", "offline_tau_dflash_decay", "decode_tau_dflash2_warm", "store", "store_text"},
}


def smoke(script: str, *args: str, env: dict | None = None) -> dict:
    """Run `benchmarks/<script> --smoke`; its last stdout line as JSON, RESULTS.md untouched."""
    results = (BENCHMARKS / "RESULTS.md").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )
    assert done.returncode == 0, f"{script} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{script} --smoke printed nothing"
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict), f"{script} --smoke: the last line is not one JSON object: {lines[-1][:200]}"
    assert (BENCHMARKS / "RESULTS.md").read_bytes() == results, f"{script} --smoke wrote benchmarks/RESULTS.md"
    return figures
