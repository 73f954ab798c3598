"""Extraction overhead and worker scaling, on one model and one corpus in one run.

    python benchmarks/extract_bench.py [--quick | --smoke]

Target: a random-weight Qwen3.5 hybrid (linear + full attention) with hidden 512 and
6 layers, built and saved on the fly (nothing downloaded), 3 context layers
([1, 2, 3]: the forward stops after layer 3). Corpus: chat records answering with
Python standard-library source, rendered with a real (locally trained) tokenizer's
chat template. A local Ray cluster, CPU workers with one torch thread each.

What is timed (identically excluded on every side: Ray start, actor start, model
load and each actor's one warm-up forward, i.e. the job report's ``startup_seconds``):

- extract (1 worker / 2 workers): the job's dispatch phase (`extract_seconds` in its
  report) -- from the first shard handed out to the last one committed: re-tokenizing
  every shard, the forwards, host copies, compression, checksums, fsyncs and commits.
- forward-only (1 worker): the same shards' samples, same length batching (groups of
  ``--batch-shards`` shards), through the same `TargetRunner` in the same kind of
  actor, nothing written; tokenization done before the clock starts.

padded_token_ratio = tokens the device computed (each batch padded to its longest
sample) / real tokens, as the job reports it; beside it the ratio batching each
shard alone would give on the same plan (`padded_token_ratio_per_shard`), i.e.
before batch groups.

overhead_ratio = extract(1 worker) / forward-only(1 worker); goal <= 1.05.
scaling_2v1 = tokens/s with 2 workers / tokens/s with 1; goal >= 1.8. Beside it, the
machine's own ceiling: bare forwards on 2 workers / 1 (forward_only_scaling_2v1), and
the job's efficiency = scaling_2v1 / that ceiling (2 vCPUs that share caches or a
busy host cap both alike).
plan_records_per_s: planning at Qwen3.6's real vocabulary (`benchmarks/plan_bench.py`);
goal >= 100 on 2 cores. ``--plan-only`` measures just that.
Appends to benchmarks/RESULTS.md and prints one JSON line last (``--smoke``: tiny
corpus and plan, the JSON line only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.chdir(ROOT)  # Ray workers import the project from the driver's working directory

from benchmarks.common import Timer, add_smoke_flag, append_results  # noqa: E402
from benchmarks.plan_bench import plan_figures, plan_rows  # noqa: E402

HIDDEN, LAYERS, CONTEXT_LAYERS = 512, 6, 3
BATCH_TOKENS = 4096
# samples, shard tokens, plan records (a smoke plan still spans 3 chunks of 256: two planning processes)
SIZES = {"smoke": (24, 1500, 600), "quick": (200, 3000, 4000), "full": (600, 6000, 4000)}


def build_inputs(root: Path, samples: int) -> tuple[Path, Path]:
    import builders

    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    builders.build_tokenizer(tokenizer_dir)
    model = root / "model"
    builders.build_model(model, kind="qwen3_5", vocab_size=512, hidden_size=HIDDEN, num_layers=LAYERS)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, model / file.name)
    corpus = builders.write_chat_jsonl(root / "corpus.jsonl", builders.coding_chats(samples))
    return model, corpus


def forward_only(config, store: Path, workers: int = 1) -> dict:
    """Fresh actors of the job's kind; time their forward passes over every shard
    (dealt round-robin, all workers starting on the same clock tick). Throughput is
    all tokens over the slowest worker's time: what the machine gives bare forwards."""
    import time

    import ray

    from extract.extraction.job import Extraction
    from extract.extraction.layers import resolve_layer_ids
    from extract.jobs.batching import batch_groups
    from store_schema import Store
    from store_schema.fingerprint import target_identity
    from store_schema.runtime.target_config import read_target_config
    from store_schema.stores import backend

    plan = Store(store).plan()
    target = read_target_config(config.model)
    layer_ids = resolve_layer_ids(target, None, config.num_context_layers)
    # the job's own actor spec (what `run_job` gives each actor), so both sides run the same worker
    spec = Extraction(config, backend(config.store), target, layer_ids, target_identity(config.model)).worker_spec(plan)
    actor_class = spec.actor_class()
    actors = [ray.remote(num_cpus=1, max_concurrency=2)(actor_class).remote(spec) for _ in range(workers)]
    try:
        ray.get([actor.info.remote() for actor in actors])  # started and warmed up, off the clock
        groups = batch_groups([s.name for s in plan.shards], config.batch_shards)
        start_at = time.time() + 3.0
        results = ray.get([actor.forward_only.remote(groups[i::workers], start_at) for i, actor in enumerate(actors)])
        return {
            "seconds": max(r.seconds for r in results),
            "tokens": sum(r.tokens for r in results),
            "padded_tokens": sum(r.padded_tokens for r in results),
        }
    finally:
        for actor in actors:
            ray.kill(actor)


def shard_lengths(store: Path) -> list[list[int]]:
    from store_schema import Store

    return [[s.num_tokens for s in shard.samples] for shard in Store(store).plan().shards]


def per_shard_padded_ratio(shards: list[list[int]], batch_tokens: int) -> float:
    """What batching each shard's samples alone (the job's cutting rule) would compute, over the real tokens."""
    from extract.jobs.batching import batches_min_padding, padded_tokens

    padded = sum(padded_tokens(lengths, batches_min_padding(lengths, batch_tokens)) for lengths in shards)
    return padded / sum(map(sum, shards))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small corpus (< 3 minutes on 2 cores)")
    add_smoke_flag(parser)
    parser.add_argument("--plan-only", action="store_true", help="only plan_records_per_s (real vocabulary)")
    args = parser.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    samples, shard_tokens, plan_records = SIZES[mode]
    if args.plan_only:
        root = Path(tempfile.mkdtemp(prefix="plan_bench_"))
        try:
            planning = plan_figures(root, plan_records)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        append_results(
            f"extract_bench (plan only): {planning['plan_records']} agentic records, Qwen3.6 vocabulary",
            plan_rows(planning),
            planning,
            smoke=args.smoke,
        )
        return 0

    import ray
    from transformers.utils import logging as hf_logging

    from extract.extraction.config import JobConfig
    from extract.extraction.job import run_job
    from extract.jobs.settings import Execution
    from store_schema.plan import PlanSettings

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    load_before = [round(x, 2) for x in os.getloadavg()]
    root = Path(tempfile.mkdtemp(prefix="extract_bench_"))
    try:
        planning = plan_figures(root, plan_records)
        with Timer() as setup:
            model, corpus = build_inputs(root, samples)
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")

        def config(store: str, workers: int) -> JobConfig:
            return JobConfig(
                model=str(model),
                corpus=str(corpus),
                store=str(root / store),
                num_context_layers=CONTEXT_LAYERS,
                plan_settings=PlanSettings(shard_tokens=shard_tokens),
                batch_tokens=BATCH_TOKENS,
                execution=Execution(workers=workers, device="cpu", cpus_per_worker=1),
            )

        one = run_job(config("store1", 1), log=lambda m: None)
        plan_lengths = shard_lengths(root / "store1")
        forward = forward_only(config("store1", 1), root / "store1")
        two = run_job(config("store2", 2), log=lambda m: None)
        forward2 = forward_only(config("store1", 1), root / "store1", workers=2)
        ray.shutdown()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    forward_tps = forward["tokens"] / forward["seconds"]
    per_shard = per_shard_padded_ratio(plan_lengths, BATCH_TOKENS)
    overhead = one["extract_seconds"] / forward["seconds"]
    scaling = two["tokens_per_s"] / one["tokens_per_s"]
    ceiling = (forward2["tokens"] / forward2["seconds"]) / forward_tps  # bare forwards, 2 workers / 1
    assert forward["tokens"] == one["tokens_written"] == two["tokens_written"]
    assert forward["padded_tokens"] == one["padded_tokens"] == two["padded_tokens"]  # batching fixed by the plan
    figures = {
        "padded_token_ratio": one["padded_token_ratio"],
        "padded_token_ratio_per_shard": round(per_shard, 4),
        "batch_shards": one["batch_shards"],
        "overhead_ratio": round(overhead, 4),
        "scaling_2v1": round(scaling, 4),
        "forward_only_scaling_2v1": round(ceiling, 4),
        "scaling_efficiency": round(scaling / ceiling, 4),
        "loadavg_before": load_before,
        "tokens": one["tokens"],
        "samples": one["samples"],
        "shards": one["shards"],
        "forward_only_seconds": round(forward["seconds"], 3),
        "extract_1w_seconds": one["extract_seconds"],
        "extract_2w_seconds": two["extract_seconds"],
        "forward_only_tokens_per_s": round(forward_tps, 1),
        "extract_1w_tokens_per_s": one["tokens_per_s"],
        "extract_2w_tokens_per_s": two["tokens_per_s"],
        "extract_1w_bytes_per_s": one["bytes_per_s"],
        "extract_2w_bytes_per_s": two["bytes_per_s"],
        "startup_seconds_1w_2w": [one["startup_seconds"], two["startup_seconds"]],
        "setup_seconds": round(setup.seconds, 2),
        "model": f"Qwen3.5 hybrid hidden {HIDDEN}, {LAYERS} layers, layers {one['layer_ids']}",
        "kernels": one["kernels"],
        "quick": args.quick,
        "smoke": args.smoke,
        **planning,
    }
    append_results(
        f"extract_bench ({mode}): {one['tokens']} tokens, {one['shards']} shards, Qwen3.5 hybrid "
        f"hidden {HIDDEN} x {LAYERS} layers, CPU workers with 1 torch thread",
        [
            (
                f"padded_token_ratio (computed / real tokens, batch groups of {one['batch_shards']} shards)",
                "-",
                f"{one['padded_token_ratio']:.3f}",
            ),
            ("padded_token_ratio batching each shard alone (before)", "-", f"{per_shard:.3f}"),
            ("overhead_ratio (extract / forward-only, 1 worker)", "<= 1.05", f"{overhead:.3f}"),
            ("scaling_2v1 (tokens/s, 2 workers / 1)", ">= 1.8", f"{scaling:.3f}"),
            ("forward-only scaling 2v1 (this machine's ceiling)", "info", f"{ceiling:.3f}"),
            ("scaling efficiency (scaling_2v1 / ceiling)", "-", f"{scaling / ceiling:.3f}"),
            ("forward-only tokens/s (1 worker)", "-", f"{forward_tps:.0f}"),
            ("extract tokens/s (1 / 2 workers)", "-", f"{one['tokens_per_s']:.0f} / {two['tokens_per_s']:.0f}"),
            (
                "extract MB/s on disk (1 / 2 workers)",
                "-",
                f"{one['bytes_per_s'] / 1e6:.2f} / {two['bytes_per_s'] / 1e6:.2f}",
            ),
            ("excluded from both sides", "-", "Ray start, actor start, model load, warm-up forward"),
            ("load average before (1/5/15 min)", "-", " ".join(map(str, load_before))),
            *plan_rows(planning),
        ],
        figures,
        smoke=args.smoke,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
