"""Costs that grow with the job: how long `fit` takes to reach step 1 as the store grows.

    python benchmarks/scale_bench.py [--quick | --smoke]

Appends a section to benchmarks/RESULTS.md and prints one JSON line last:

- start_s_{1,4,16}x: seconds `Trainer.from_config` takes (every check before
  step 1, the drafter built, the loader started) on stores of 1x, 4x and 16x the
  shards, each shard the same size, with the page cache emptied first: the
  default start check (the commit journal against the committed shards, a few
  shards re-read in full; the loader checks the rest as it opens them) and, as
  `verify_first_s_*`, `--verify-first` (every committed file re-read). Best of
  `--rounds`.
- start_ratio_16x_vs_1x: the default's 16x figure over its 1x figure (goal <= 1.2).
- plan_check_s: the start's store-level check (root, plan read, plan digest) on a
  store whose plan holds the full corpus's 902,000 samples, cold.
- start_s_per_1000_shards and start_s_full_store_projected: the default's growth
  per shard (the 16x and 1x figures' difference over the shards between them),
  and that slope times the full job's ~80,000 shards plus plan_check_s on top of
  the 1x figure.

With `--metadata-shards N` (10,000 for the issue's figure) it also builds a store of
N tiny committed shards with a plan and times what grows with the shard count, not
the bytes: `store_schema info` (`info_s`), `verify --sizes-only` (`verify_sizes_s`)
and fit's start to a trainer ready for step 1 (`fit_start_s`), each cold.

With `--rerun-shards N` (10,000 for the issue) and `--bucket-rerun-shards M` (2,000,
on a loopback moto_server) it extracts that many one-sample shards for real and times
`extract run` run again, which has nothing to do (`local_rerun_s`, `bucket_rerun_s`;
`benchmarks/rerun_scale.py`).

The target is a tiny Qwen3 of random weights and the drafter one layer: the
figures are the start's own cost, not the model's."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, add_smoke_flag, append_results, drop_page_cache, tiny_target

HIDDEN, VOCAB, TARGET_LAYERS, LAYERS = 1024, 2048, 4, [1, 2]
FULL_JOB_SHARDS = 80_000  # ~2.6 B tokens in shards of 32,768 tokens
FULL_JOB_SAMPLES = 902_000  # the corpus's samples: what the plan the start reads and checks holds
SCALES = (1, 4, 16)


def new_store(path: Path, tokens: int):
    """A bench store's writer: LAYERS of a HIDDEN-wide target, samples of `tokens`."""
    from store_schema import CodecConfig, Fingerprint, create_store

    fingerprint = Fingerprint(
        target_model="bench",
        num_target_layers=TARGET_LAYERS,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        layer_ids=LAYERS,
        max_length=tokens,
    )
    return create_store(path, fingerprint, CodecConfig())


def planned_tokens(num_shards: int, samples: int, tokens: int) -> list[list[tuple[str, np.ndarray, np.ndarray]]]:
    """Each shard's samples as (id, tokens, loss mask): random ids, the first eighth masked."""
    rng = np.random.default_rng(0)
    mask = np.ones(tokens, np.uint8)
    mask[: tokens // 8] = 0
    return [
        [(f"s{s}-{i}", rng.integers(0, VOCAB, tokens).astype(np.int32), mask) for i in range(samples)]
        for s in range(num_shards)
    ]


def plan_of(shards: list[list[tuple[str, np.ndarray, np.ndarray]]]):
    """The plan a real job commits before its shards: these shards of these samples."""
    from store_schema import Plan, PlannedSample, PlannedShard, sample_digest, shard_name

    def planned(s: int, i: int, sample_id: str, ids: np.ndarray, mask: np.ndarray) -> PlannedSample:
        digest = sample_digest(ids.tobytes(), mask.tobytes())
        return PlannedSample(sample_id, s * len(shards[0]) + i, len(ids), int(mask.sum()), digest)

    return Plan(
        tuple(
            PlannedShard(shard_name(s), tuple(planned(s, i, *sample) for i, sample in enumerate(batch)))
            for s, batch in enumerate(shards)
        ),
        (),
        settings={"source": "scale_bench"},
    )


def write_planned(path: Path, shards: list, tokens: int) -> float:
    """A store of `shards` (`planned_tokens`) with random states, its plan committed
    first as a job's is; the seconds the shards' writes took."""
    from store_schema import SampleArrays, shard_name

    writer = new_store(path, tokens)
    writer.write_plan(plan_of(shards))
    with Timer() as t:
        for s, batch in enumerate(shards):
            states = [{layer: torch.randn(tokens, HIDDEN).to(torch.bfloat16) for layer in LAYERS} for _ in batch]
            writer.write_shard(shard_name(s), [SampleArrays(*x, h) for x, h in zip(batch, states)])
    return t.seconds


def build_store(path: Path, num_shards: int, samples: int, tokens: int) -> int:
    """`num_shards` shards of `samples` x `tokens` random states of LAYERS, with their
    plan; bytes on disk."""
    from store_schema.commit.records import on_disk_bytes

    write_planned(path, planned_tokens(num_shards, samples, tokens), tokens)
    return on_disk_bytes(path)


def start_seconds(store: Path, target: Path, out: Path, verify_first: bool) -> float:
    """Seconds to a trainer ready for step 1, from a cold page cache."""
    from train.config_loading import load_config
    from train.fitting.preflight import FitChecks
    from train.fitting.trainer import Trainer

    sets = [
        "model.num_hidden_layers=1",
        "model.num_anchors=16",
        "model.mask_token_id=0",
        "data.heldout_fraction=0",
        "eval.every=0",
        "train.checkpoint_every=0",
        "train.max_steps=1",
    ]
    config = load_config(None, sets, store=str(store), target=str(target), out=str(out))
    drop_page_cache(store)
    with Timer() as t:
        trainer = Trainer.from_config(config, log=lambda line: None, checks=FitChecks(verify_first=verify_first))
    trainer.feed.close()
    shutil.rmtree(out, ignore_errors=True)
    return t.seconds


def build_tiny_shards(path: Path, num_shards: int) -> float:
    """`num_shards` committed shards of one 64-token sample each, with their plan;
    the seconds the writer took."""
    return write_planned(path, planned_tokens(num_shards, 1, 64), 64)


def metadata(root: Path, num_shards: int) -> dict:
    """What grows with the shard count: info, verify --sizes-only, fit's start."""
    import subprocess

    target = tiny_target(root / "meta-target", HIDDEN, VOCAB, TARGET_LAYERS)
    store = root / "meta-store"
    build_s = build_tiny_shards(store, num_shards)
    timed = {}
    for name, argv in (
        ("info_s", ["-m", "store_schema", "info", str(store), "--json"]),
        ("verify_sizes_s", ["-m", "store_schema", "verify", str(store), "--sizes-only", "--json"]),
    ):
        drop_page_cache(store)
        with Timer() as t:
            done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        timed[name] = round(t.seconds, 2)
    timed["fit_start_s"] = round(start_seconds(store, target, root / "meta-run", False), 2)
    return {"metadata_shards": num_shards, "metadata_build_s": round(build_s, 1), **timed}


def reruns(root: Path, local_shards: int, bucket_shards: int) -> dict:
    """`extract run` again on a finished job of `local_shards` local and `bucket_shards`
    bucket shards (either 0: not measured)."""
    from benchmarks import rerun_scale
    from benchmarks.common import loopback_s3, new_bucket

    figures = {}
    if local_shards:
        store = str(root / "rerun-store")
        figures.update(rerun_scale.rerun_figures(root / "rerun-local", local_shards, store, "local"))
    if bucket_shards:
        with loopback_s3() as endpoint:
            url = f"s3://{new_bucket(endpoint)}/store"
            figures.update(rerun_scale.rerun_figures(root / "rerun-bucket", bucket_shards, url, "bucket"))
    return figures


def plan_check_seconds(root: Path, num_samples: int, num_shards: int) -> float:
    """Seconds the start's store-level check (root and plan records, the plan read
    and its digest compared) takes on a store whose plan holds `num_samples` samples
    in `num_shards` shards, cold: what grows with the corpus, not with the shards."""
    from store_schema import Plan, PlannedSample, PlannedShard, shard_name
    from store_schema.stores import open_store
    from store_schema.tools.verify import verify_store

    per_shard = -(-num_samples // num_shards)
    samples = [PlannedSample(f"rec-{i:07d}", i, 2900, 1500, f"{i:064x}") for i in range(num_samples)]
    plan = Plan(
        tuple(
            PlannedShard(shard_name(s), tuple(samples[s * per_shard : (s + 1) * per_shard])) for s in range(num_shards)
        ),
        (),
        settings={"source": "scale_bench"},
    )
    path = root / "plan-store"
    new_store(path, 64).write_plan(plan)
    drop_page_cache(path)
    with Timer() as t:
        problems = verify_store(open_store(path), shards=[]).problems
    assert not problems, problems[:3]
    return t.seconds


def measure(root: Path, base_shards: int, samples: int, tokens: int, rounds: int, plan_samples: int) -> dict:
    target = tiny_target(root / "target", HIDDEN, VOCAB, TARGET_LAYERS)
    stores = {scale: root / f"store-{scale}x" for scale in SCALES}
    sizes = {scale: build_store(path, scale * base_shards, samples, tokens) for scale, path in stores.items()}
    start_seconds(stores[1], target, root / "warm", False)  # imports and first-use costs out of the way
    default = {scale: [] for scale in SCALES}
    first = {scale: [] for scale in SCALES}
    for _ in range(rounds):
        for scale, path in stores.items():
            default[scale].append(start_seconds(path, target, root / "run", False))
            first[scale].append(start_seconds(path, target, root / "run", True))
    best = {scale: min(default[scale]) for scale in SCALES}
    slope = max(0.0, best[16] - best[1]) / (15 * base_shards)
    plan_s = plan_check_seconds(root, plan_samples, min(FULL_JOB_SHARDS, plan_samples))
    figures = {f"start_s_{scale}x": round(best[scale], 3) for scale in SCALES}
    figures.update({f"verify_first_s_{scale}x": round(min(first[scale]), 3) for scale in SCALES})
    figures.update(
        {
            "start_ratio_16x_vs_1x": round(best[16] / best[1], 3),
            "start_s_per_1000_shards": round(1000 * slope, 3),
            "plan_check_s": round(plan_s, 2),
            "plan_samples": plan_samples,
            "start_s_full_store_projected": round(best[1] + FULL_JOB_SHARDS * slope + plan_s, 1),
            "shards": {f"{scale}x": scale * base_shards for scale in SCALES},
            "store_bytes": {f"{scale}x": sizes[scale] for scale in SCALES},
            "rounds": rounds,
        }
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 shards at 1x (8 otherwise), 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--metadata-shards",
        type=int,
        default=0,
        metavar="N",
        help="also time info, verify --sizes-only and fit's start on N tiny shards (e.g. 10000)",
    )
    parser.add_argument("--rerun-shards", type=int, default=0, metavar="N", help="time extract run's rerun at N shards")
    parser.add_argument(
        "--bucket-rerun-shards", type=int, default=0, metavar="M", help="... and at M shards on a moto_server bucket"
    )
    parser.add_argument("--metadata-only", action="store_true", help="only the --metadata-shards and --rerun figures")
    add_smoke_flag(parser)
    args = parser.parse_args()
    base, samples, tokens, rounds = (1, 1, 256, 1) if args.smoke else (4, 4, 1024, 2) if args.quick else (8, 4, 4096, 3)
    root = Path(tempfile.mkdtemp(prefix="scale_bench_"))
    meta_shards = 20 if args.smoke else args.metadata_shards
    try:
        plan_samples = 2_000 if args.smoke else FULL_JOB_SAMPLES
        figures = (
            {} if args.metadata_only else measure(root, base, samples, tokens, args.rounds or rounds, plan_samples)
        )
        if meta_shards:
            figures.update(metadata(root, meta_shards))
        figures.update(
            reruns(root, 8 if args.smoke else args.rerun_shards, 4 if args.smoke else args.bucket_rerun_shards)
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.metadata_only:
        rows = [
            (f"{key} ({meta_shards:,} one-sample shards, cold)", "-", str(figures[key]))
            for key in ("info_s", "verify_sizes_s", "fit_start_s", "metadata_build_s")
            if key in figures
        ]
        rows += [
            (
                f"{where}_rerun_s: `extract run` again, nothing to do ({figures[f'{where}_shards']:,} shards)",
                "<= 30",
                f"{figures[f'{where}_rerun_s']} (extracting them: {figures[f'{where}_build_s']} s)",
            )
            for where in ("local", "bucket")
            if f"{where}_rerun_s" in figures
        ]
        append_results("scale_bench: metadata at many shards", rows, figures, smoke=args.smoke)
        return
    mb = {scale: figures["store_bytes"][scale] / 1e6 for scale in figures["store_bytes"]}
    rows = [
        (
            f"seconds before step 1, {scale} ({figures['shards'][scale]} shards, {mb[scale]:.0f} MB)",
            "flat",
            f"{figures[f'start_s_{scale}']} (--verify-first: {figures[f'verify_first_s_{scale}']})",
        )
        for scale in ("1x", "4x", "16x")
    ]
    rows += [
        ("start_ratio_16x_vs_1x", "<= 1.2", str(figures["start_ratio_16x_vs_1x"])),
        (
            f"the plan's check at {figures['plan_samples']:,} samples (cold)",
            "-",
            str(figures["plan_check_s"]),
        ),
        (
            "start_s_full_store_projected (80,000 shards, 902,000 samples)",
            "<= 60",
            f"{figures['start_s_full_store_projected']} ({figures['start_s_per_1000_shards']} s per 1,000 shards "
            "+ the plan's check)",
        ),
    ]
    append_results("scale_bench: fit's start as the store grows", rows, figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
