"""Run the store, extraction, trainer and drafter benchmarks in one go and append their
figures to benchmarks/RESULTS.md as one table (figure, goal, measured, machine, command).

    python benchmarks/run_all.py [--quick | --smoke] [--only NAME[,NAME...]]

Prints one JSON line last merging every benchmark's figures (keys prefixed by the
benchmark: store.bytes_ratio, extract.overhead_ratio, train.loader_efficiency, ...).
``--smoke`` runs each benchmark's smoke mode and only prints that line. ``--only
store,train`` runs just the named ones (of store, extract, train, drafter; still in
that order), and the table gets only their figures."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.common import RESULTS, SMOKE_HELP, machine  # noqa: E402

BENCHMARKS = ("store", "extract", "train", "drafter")  # benchmarks/<name>_bench.py, in this order
# (benchmark, figure, goal as text, check or None)
GOALS = [
    ("store", "bytes_ratio", "<= 0.70", lambda v: v <= 0.70),
    ("store", "epoch_read_ratio_vs_torch_save", ">= 1.0 (cold)", lambda v: v >= 1.0),
    ("store", "fp8_bytes_ratio", "<= 0.40", lambda v: v <= 0.40),
    ("store", "fp8_epoch_read_ratio_vs_torch_save", "- (cold, information)", None),
    ("store", "blosc_v1_epoch_read_ratio_vs_torch_save", "- (the v1 codec, cold, information)", None),
    ("store", "decode_gb_per_s_per_core", "- (per codec, information)", None),
    ("store", "loader_cores_for_36k_tok_s", "- (per codec, information)", None),
    ("store", "verify_gb_per_s", "- (all cores, cold, information)", None),
    ("store", "epoch_read_ratio_vs_torch_save_warm", "- (warm, information)", None),
    ("store", "write_mb_s", "- (with fsync)", None),
    ("store", "encode_mb_s_per_core", ">= 500 (bf16 and fp8, crc32c included)", lambda v: min(v.values()) >= 500),
    ("store", "writer_cores_per_gpu_at_9000", "- (match table auto: full where it saves >= 2 %)", None),
    (
        "store",
        "writer_cores_per_gpu_at_9000_small_table",
        "<= 0.8 (bf16, match table small)",
        lambda v: v["bfloat16"] <= 0.8,
    ),
    ("store", "bf16_full_match_table_saving", "- (bytes, these states)", None),
    ("store", "window_read_ratio_vs_torch_save_cold", "- (information)", None),
    ("store", "shard_cache_read_ratio_vs_local", ">= 0.9 (warm cache)", lambda v: v >= 0.9),
    ("store", "shard_cache_fill_mb_s", "- (moto on loopback, information)", None),
    ("store", "trainer_data_wait_share_cache", "<= 0.01 (train fit, warm cache)", lambda v: v <= 0.01),
    ("store", "trainer_data_wait_share_local", "- (train fit, local store, information)", None),
    ("extract", "overhead_ratio", "<= 1.05", lambda v: v <= 1.05),
    ("extract", "scaling_2v1", ">= 1.8", lambda v: v >= 1.8),
    ("extract", "forward_only_scaling_2v1", "- (this machine's ceiling)", None),
    ("train", "loss_memory_ratio", "<= 0.15", lambda v: v <= 0.15),
    ("train", "loader_efficiency", ">= 0.8", lambda v: v >= 0.8),
    ("train", "loader_tokens_per_s", "- (seeds' trainer consumed ~36K/s on one GPU)", None),
    ("train", "ddp_scaling_2v1", ">= 1.7", lambda v: v >= 1.7),
    ("train", "fit_step_s_1rank", "- (one optimizer step, one process, information)", None),
    ("drafter", "dflash2_vs_dflash_decode_tau", ">= 1.05 (DFlash 2 / DFlash, equal steps)", lambda v: v >= 1.05),
    ("drafter", "dflash2_warm_vs_dflash_decode_tau", "- (warm-started from the DFlash run)", None),
    ("drafter", "dpace_vs_decay_decode_tau", "- (D-PACE / decay, DFlash)", None),
    ("drafter", "decode_tau_dflash_decay", "- (information)", None),
]


def run_benchmark(name: str, mode: list[str]) -> tuple[dict, str, float]:
    command = [sys.executable, str(HERE / f"{name}_bench.py"), *mode]
    print(f"== {name}_bench ==", file=sys.stderr, flush=True)
    start = time.time()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    result = subprocess.run(command, cwd=HERE.parent, env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{name}_bench failed (exit {result.returncode})")
    shown = " ".join(["python", f"benchmarks/{name}_bench.py", *mode])
    return json.loads(lines[-1]), shown, time.time() - start


def benchmark_names(text: str) -> tuple[str, ...]:
    """`--only`'s comma-separated names, each one of BENCHMARKS, in BENCHMARKS' order."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(BENCHMARKS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected names among {', '.join(BENCHMARKS)}, got {text!r}")
    return tuple(name for name in BENCHMARKS if name in names)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="each benchmark's quick size")
    mode.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument(
        "--only",
        type=benchmark_names,
        default=BENCHMARKS,
        metavar="NAME[,NAME...]",
        help=f"run just these benchmarks (of {', '.join(BENCHMARKS)})",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    flags = ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
    figures, commands, seconds = {}, {}, {}
    for name in args.only:
        figures[name], commands[name], seconds[name] = run_benchmark(name, flags)
    merged = {f"{bench}.{key}": value for bench, values in figures.items() for key, value in values.items()}
    if args.smoke:
        print(json.dumps(merged))
        return

    host = machine()
    only = "" if args.only == BENCHMARKS else f" --only {','.join(args.only)}"
    lines = [
        f"\n## run_all{' --quick' if args.quick else ''}{only} ({time.strftime('%Y-%m-%d %H:%M')})\n",
        f"Cold reads empty the page cache first ({figures.get('store', {}).get('cache', 'posix_fadvise')}).\n",
        "| figure | goal | measured | met | machine | command |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for bench, key, goal, check in GOALS:
        if bench not in figures:
            continue
        value = figures[bench].get(key)
        met = "-" if check is None or value is None else ("yes" if check(value) else "**no**")
        lines.append(f"| {bench}.{key} | {goal} | {value} | {met} | {host} | `{commands[bench]}` |")
    lines += ["", "Wall time per benchmark: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()), ""]
    with RESULTS.open("a") as f:
        f.write("\n".join(lines))
    print(json.dumps(merged))


if __name__ == "__main__":
    main()
