"""Every benchmark's `--smoke` runs here as a user would run it (a child process, the
JSON line it prints last checked for the keys it promises), so no benchmark can rot
between the runs that measure with it (`extract_bench --quick` once crashed on main
unnoticed). A smoke run never writes benchmarks/RESULTS.md. gpu_check's smoke has its
own test (tests/extract/test_gpu_check.py); generate_bench's runs in tests/extract/test_generate_openai.py,
on that module's vLLM server (a server start is ~45 s of CPU). The smokes of extract,
train and drafter, the longest (1-2 min each), are each in a file of their own
(tests/test_benchmarks_<name>.py): `make test` runs its two pytest workers with
`--dist loadfile`, a module at a time, so only separate modules can run side by side.
run_all's own test runs the cheapest, store_bench, and is store_bench's smoke test too."""

from __future__ import annotations

import pytest
from benchmark_smoke import BENCHMARKS, SMOKE_KEYS, run_all_module, smoke

RUN_ALL_ONLY = "store"  # the cheapest of run_all's benchmarks; its test is store_bench's smoke test too


def test_every_benchmark_script_has_a_smoke_test():
    scripts = {path.name for path in BENCHMARKS.glob("*.py") if '__name__ == "__main__"' in path.read_text()}
    # gpu_check.py and the wheel list it runs from: tests/extract/test_gpu_check.py
    covered = set(SMOKE_KEYS) | {"run_all.py", "gpu_check.py", "device_wheels.py"}
    assert scripts == covered, f"benchmarks without a smoke test: {sorted(scripts - covered)}"
    assert {f"{name}_bench.py" for name in run_all_module().BENCHMARKS} <= set(SMOKE_KEYS)


@pytest.mark.slow  # child processes
def test_attention_bench_smoke():
    figures = smoke("attention_bench.py")
    assert SMOKE_KEYS["attention_bench.py"] <= set(figures) and figures["smoke"] is True
    assert figures["sizes"][0]["max_abs_diff"] < 1e-4  # split and dense SDPA agree


def test_run_all_only_takes_named_benchmarks_in_its_own_order():
    module = run_all_module()
    assert list(module.BENCHMARKS) == ["store", "extract", "train", "drafter"]
    assert module.parse_args(["--smoke"]).only == module.BENCHMARKS  # every benchmark by default
    assert module.parse_args(["--only", "train,store"]).only == ("store", "train")  # run_all's order
    with pytest.raises(SystemExit):
        module.parse_args(["--only", "store,nope"])


@pytest.mark.slow  # child processes
def test_run_all_smoke_runs_store_bench_smoke_and_prefixes_its_figures():
    """One run checks both: run_all runs only the named benchmark and prefixes its
    figures, and store_bench's own smoke (run_all's child, `store_bench.py --smoke`)
    promises its keys (running store_bench's smoke a second time on its own cost ~1 min)."""
    prefixed = smoke("run_all.py", "--only", RUN_ALL_ONLY)
    assert {key.split(".", 1)[0] for key in prefixed} == {RUN_ALL_ONLY}  # only the named one ran
    figures = {key.split(".", 1)[1]: value for key, value in prefixed.items()}
    missing = SMOKE_KEYS[f"{RUN_ALL_ONLY}_bench.py"] - set(figures)
    assert not missing, f"run_all --smoke --only {RUN_ALL_ONLY} lacks {sorted(f'{RUN_ALL_ONLY}.{k}' for k in missing)}"
    assert figures["smoke"] is True
    assert figures["shard_cache_fill_mb_s"] > 0 and figures["shard_cache_read_ratio_vs_local"] > 0
    epochs = figures["shard_cache_epoch_seconds"]  # the ratio's rounds: epochs after the fill, never the fill
    assert {k: [len(r) for r in v] for k, v in epochs.items()} == {"cache": [6] * 5, "local": [6] * 5}
    assert figures["uploader_mb_s"] > 0
    assert 0 <= figures["trainer_data_wait_share_cache"] <= 1
    assert 0 <= figures["trainer_data_wait_share_local"] <= 1
    assert figures["trainer_fit"]["cache"]["shards_fetched"] == 0  # the measured fit read a warm cache


@pytest.mark.slow  # a child process
def test_fp4_formats_smoke():
    """The chosen format is among those measured, and a finer or e4m3 scale costs bytes."""
    figures = smoke("fp4_formats.py")
    assert SMOKE_KEYS["fp4_formats.py"] <= set(figures) and figures["smoke"] is True
    formats = figures["formats"]
    assert figures["chosen"] in formats
    assert formats["pow2_32"]["bytes_ratio"] < min(formats[name]["bytes_ratio"] for name in ("pow2_16", "e4m3_16"))
    assert formats["e4m3_16"]["relative_rms"] < formats["pow2_32"]["relative_rms"]


@pytest.mark.slow  # a child process
def test_layers_bench_smoke():
    figures = smoke("layers_bench.py")
    assert SMOKE_KEYS["layers_bench.py"] <= set(figures)
    assert figures["store_bytes"]["union"] > figures["store_bytes"]["own"]  # 9 layers stored against 5


@pytest.mark.slow  # a child process
def test_scale_bench_smoke():
    figures = smoke("scale_bench.py")
    assert SMOKE_KEYS["scale_bench.py"] <= set(figures)
    assert all(figures[f"start_s_{scale}x"] > 0 for scale in (1, 4, 16))


@pytest.mark.slow  # a child process
def test_codebook_optim_bench_smoke():
    figures = smoke("codebook_optim_bench.py")
    assert SMOKE_KEYS["codebook_optim_bench.py"] <= set(figures)
