"""Trainer benchmarks: memory of the chunked loss, and how well the streaming
loader keeps up with decompression.

    python benchmarks/train_bench.py [--quick | --smoke]

Appends a section to benchmarks/RESULTS.md and prints one JSON line last:

- loss_memory_ratio: peak extra memory of `train.families.dflash.loss.dflash_loss` (chunked,
  `loss.chunk_rows` rows at a time) over a naive loss that materialises the full
  [anchors*B, V] fp32 logits, at V = 248,320, 512 anchors x 16, forward + backward.
  Method on CPU: each variant runs in a fresh subprocess; its peak is the
  process's `ru_maxrss` minus its resident size just before the loss (inputs
  already allocated). The naive loss at 512 anchors needs ~24 GB, more than this
  machine has, so it is measured at 64/128 (and 192 in full mode) anchors and
  extrapolated linearly (its memory is linear in rows: logits, log-softmax,
  gradient); the chunked loss is measured directly at 512 anchors. With CUDA both
  are measured directly with `torch.cuda.max_memory_allocated`. Hidden size 64:
  the hidden size changes the inputs, not the [rows, V] buffers being compared.
- loader_efficiency: bytes/s of context features the streaming loader delivers
  to a consumer that draws anchors and builds block targets per sample
  (5 context layers x 5120 bf16, samples of 1-3K tokens cropped at 3072, order
  shuffled), over the raw rate of `Store.iter_shards` decoding the same shards
  with the same threads, in the same run, both with the page cache emptied first;
  the two passes alternate for `--rounds` rounds and each keeps its best round.
  The attention mask is built on the GPU (flex BlockMask), not by the loader.
- loader_tokens_per_s, beside the ~36K tokens/s the seeds' trainer consumed on
  one GPU (77 samples of ~2.9K tokens per ~6 s step).
- ddp_scaling_2v1: training sequences/s of `python -m train fit --nproc 2` (two
  gloo ranks, one thread each) over the same run in one process with one
  thread, same global batch (8), same two lanes, so both train on the same
  samples. A small drafter (target hidden 256, 2 layers, 64 anchors, sequences
  of 256-512 tokens) on a store of random states; the rate is the log's
  `sequences_per_s` after the first logged interval (startup and warmup left
  out); the runs alternate for `--rounds` rounds, best of each kept. The
  machine's load average is recorded beside it (the cores are shared).
- fit_step_s_1rank / fit_step_s_2rank: the seconds of one optimizer step (the global
  batch of 8 over those rates): what the trainer's own per-step work (metrics,
  clip, optimizer, all-reduce) adds shows here first.
- ddp_2rank_vs_independent_pair: the 2-rank rate over two independent 1-rank
  fits started side by side (`ddp_independent_pair_seq_per_s`, their sum): the
  most two busy processes get from this machine, so this is DDP's own cost
  (collectives, padding) apart from what sharing the machine costs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, add_smoke_flag, append_results, drop_page_cache, tiny_target

VOCAB = 248_320
BLOCK = 16
ANCHORS = 512
HIDDEN_LOSS = 64
LAYERS = [1, 16, 31, 46, 61]  # 5 context layers of a 64-layer target
HIDDEN = 5120
SEEDS_TOKENS_PER_S = 36_000
# --smoke: the loss at 64 anchors (naive at 16 and 32), 3 fit steps (the fewest that log two
# intervals after the first, which the rate needs; a step is ~4 s of CPU per fit), 2 one-sample shards
SMOKE_ANCHORS, SMOKE_NAIVE_ANCHORS, SMOKE_DDP_STEPS = 64, (16, 32), 3


# -- loss memory -----------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def loss_child(variant: str, anchors: int, chunk_rows: int) -> dict:
    """Run one loss variant forward + backward; return its peak extra memory."""
    from train.families.dflash.config import LossConfig
    from train.families.dflash.loss import dflash_loss
    from train.families.dflash.targets import block_targets

    torch.manual_seed(0)
    length = 3072
    input_ids = torch.randint(0, VOCAB, (length,))
    loss_mask = torch.ones(length, dtype=torch.uint8)
    positions = torch.randperm(length - BLOCK)[:anchors].sort().values
    targets = block_targets(input_ids, loss_mask, positions, BLOCK, LossConfig(gamma=7.0, position_weights="decay"))
    hidden = torch.randn(anchors, BLOCK, HIDDEN_LOSS, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN_LOSS) * 0.02
    cuda = torch.cuda.is_available()
    if cuda:
        hidden, head = hidden.detach().cuda().requires_grad_(), head.cuda()
        targets = type(targets)(*(t.cuda() if torch.is_tensor(t) else t for t in vars(targets).values()))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    if variant == "chunked":
        loss = dflash_loss(hidden, head, targets, chunk_rows=chunk_rows).loss
    else:  # naive: the full [N*B, V] logits, as a plain PyTorch loss computes it
        logits = (hidden.reshape(-1, HIDDEN_LOSS) @ head.T).float()
        per_row = torch.nn.functional.cross_entropy(logits, targets.labels.flatten(), reduction="none")
        loss = (per_row * targets.weights.flatten()).sum()
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        method = "torch.cuda.max_memory_allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        method = "ru_maxrss - rss before the loss (fresh subprocess)"
    return {"variant": variant, "anchors": anchors, "peak_bytes": int(peak), "method": method}


def measure_loss(variant: str, anchors: int, chunk_rows: int) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--loss-child", variant, "--anchors", str(anchors), "--chunk-rows", str(chunk_rows)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def loss_memory(naive_sizes: tuple[int, ...], chunk_rows: int, anchors: int = ANCHORS) -> dict:
    chunked = measure_loss("chunked", anchors, chunk_rows)
    if chunked["method"].startswith("torch.cuda"):
        naive = measure_loss("naive", anchors, chunk_rows)["peak_bytes"]
        how = "measured"
        points = [(anchors, naive)]
    else:
        points = [(a, measure_loss("naive", a, chunk_rows)["peak_bytes"]) for a in naive_sizes]
        slope, intercept = np.polyfit([a for a, _ in points], [p for _, p in points], 1)
        naive = float(slope * anchors + intercept)
        how = f"extrapolated linearly from {[a for a, _ in points]} anchors"
    return {
        "chunked_bytes": chunked["peak_bytes"],
        "naive_bytes": naive,
        "naive_points": points,
        "ratio": chunked["peak_bytes"] / naive,
        "method": f"{chunked['method']}; naive {how}",
    }


# -- loader ------------------------------------------------------------------------------------
def build_store(path: Path, num_shards: int, samples_per_shard: int, seed: int = 0) -> int:
    """A store with real-size features; activation-like values (heavy-tailed, a
    few large channels) so the codec sees realistic bytes."""
    from store_schema import CodecConfig, Fingerprint, SampleArrays, create_store, shard_name

    fingerprint = Fingerprint(
        target_model="bench",
        num_target_layers=64,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        layer_ids=LAYERS,
        max_length=3072,
    )
    writer = create_store(path, fingerprint, CodecConfig())
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    channel_scale = torch.exp(torch.randn(HIDDEN, generator=generator) * 0.7)
    tokens = 0
    for s in range(num_shards):
        samples = []
        for i in range(samples_per_shard):
            n = int(rng.integers(1024, 3073))
            tokens += n
            hidden = {
                layer: (torch.randn(n, HIDDEN, generator=generator) * channel_scale).to(torch.bfloat16)
                for layer in LAYERS
            }
            mask = np.zeros(n, np.uint8)
            mask[n // 4 :] = 1
            samples.append(SampleArrays(f"b{s}-{i}", rng.integers(0, VOCAB, n).astype(np.int32), mask, hidden))
        writer.write_shard(shard_name(s), samples)
    return tokens


def raw_decode(store, threads: int) -> tuple[int, float]:
    nbytes = 0
    with Timer() as t:
        for data in store.iter_shards(store.committed_shards(), layers=LAYERS, threads=threads, prefetch=1):
            nbytes += data.nbytes
    return nbytes, t.seconds


def loader_pass(store, threads: int) -> tuple[int, int, float, float]:
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader
    from train.families.dflash.anchors import has_anchor, sample_anchors
    from train.families.dflash.config import LossConfig
    from train.families.dflash.targets import block_targets

    data = DataConfig(
        max_length=3072, heldout_fraction=0.0, buffer_shards=2, loader_threads=threads, prefetch_samples=4
    )
    loader = ShardLoader(store, data, LoaderSpec(LAYERS, partial(has_anchor, BLOCK), seed=0, epochs=1))
    generator = torch.Generator().manual_seed(0)
    nbytes = tokens = 0
    with Timer() as t:
        for sample in loader:
            anchors = sample_anchors(sample.loss_mask, BLOCK, ANCHORS, generator)
            block_targets(
                sample.input_ids, sample.loss_mask, anchors, BLOCK, LossConfig(gamma=7.0, position_weights="decay")
            )
            nbytes += sample.nbytes
            tokens += sample.num_tokens
    return nbytes, tokens, t.seconds, loader.wait_seconds


# -- data-parallel scaling --------------------------------------------------------------------
DDP_HIDDEN, DDP_VOCAB, DDP_LAYERS = 256, 2048, 4
DDP_GLOBAL_BATCH = 8  # one sequence per micro-step, 8 micro-steps a step


def build_ddp_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen3 target (random weights, saved with save_pretrained) and a store of
    random states of its layers 1 and 2: 8 shards x 6 sequences of 256-512 tokens."""
    from store_schema import CodecConfig, Fingerprint, SampleArrays, create_store, shard_name

    tiny_target(root / "target", DDP_HIDDEN, DDP_VOCAB, DDP_LAYERS)
    fingerprint = Fingerprint(
        target_model="bench",
        num_target_layers=DDP_LAYERS,
        hidden_size=DDP_HIDDEN,
        vocab_size=DDP_VOCAB,
        layer_ids=[1, 2],
        max_length=512,
    )
    writer = create_store(root / "store", fingerprint, CodecConfig())
    rng = np.random.default_rng(0)
    for s in range(8):
        samples = []
        for i in range(6):
            n = int(rng.integers(256, 513))
            hidden = {layer: torch.randn(n, DDP_HIDDEN).to(torch.bfloat16) for layer in (1, 2)}
            mask = np.ones(n, np.uint8)
            mask[: n // 4] = 0
            samples.append(SampleArrays(f"d{s}-{i}", rng.integers(0, DDP_VOCAB, n).astype(np.int32), mask, hidden))
        writer.write_shard(shard_name(s), samples)
    return root / "target", root / "store"


def _fit_command(target: Path, store: Path, out: Path, nproc: int, steps: int) -> list[str]:
    sets = [
        "model.num_hidden_layers=2",
        "model.num_anchors=64",
        "model.mask_token_id=0",
        "data.heldout_fraction=0",
        "data.loader_threads=1",
        "data.lanes=2",
        "train.batch_size=1",
        f"train.grad_accumulation={DDP_GLOBAL_BATCH}",
        "train.epochs=100",
        f"train.log_every={steps // 3}",
        "eval.every=0",
        "train.checkpoint_every=0",
        "data.buffer_shards=2",
    ]
    command = [
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
        str(steps),
        *sum((["--set", s] for s in sets), []),
    ]
    return command + (["--nproc", str(nproc)] if nproc > 1 else [])


def fit_rates(target: Path, store: Path, outs: list[Path], nproc: int, steps: int) -> list[float]:
    """Sequences/s of `train fit` runs started together (one per out directory),
    each after its first logged interval."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = [
        subprocess.Popen(
            _fit_command(target, store, out, nproc, steps),
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for out in outs
    ]
    rates = []
    for out, run in zip(outs, runs):
        output, _ = run.communicate()
        if run.returncode:
            raise SystemExit(f"train fit for {out} failed:\n{output[-4000:]}")
        rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        shutil.rmtree(out)
        rates.append(float(np.mean([row["sequences_per_s"] for row in rows[1:]])))
    return rates


def ddp_scaling(rounds: int, steps: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="ddp_bench_"))
    try:
        target, store = build_ddp_inputs(root)
        load_before = os.getloadavg()[0]
        one, two, pair = [], [], []
        for r in range(rounds):
            one += fit_rates(target, store, [root / f"one{r}"], 1, steps)
            two += fit_rates(target, store, [root / f"two{r}"], 2, steps)
            pair.append(sum(fit_rates(target, store, [root / f"pair{r}a", root / f"pair{r}b"], 1, steps)))
        load_after = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "fit_step_s_1rank": round(DDP_GLOBAL_BATCH / max(one), 3),
        "fit_step_s_2rank": round(DDP_GLOBAL_BATCH / max(two), 3),
        "ddp_scaling_2v1": round(max(two) / max(one), 3),
        "ddp_1rank_seq_per_s": round(max(one), 3),
        "ddp_2rank_seq_per_s": round(max(two), 3),
        "ddp_rounds_1rank": [round(x, 3) for x in one],
        "ddp_rounds_2rank": [round(x, 3) for x in two],
        "ddp_steps": steps,
        "ddp_independent_pair_seq_per_s": round(max(pair), 3),
        "ddp_rounds_independent_pair": [round(x, 3) for x in pair],
        "ddp_2rank_vs_independent_pair": round(max(two) / max(pair), 3),
        "ddp_load_avg": [round(load_before, 2), round(load_after, 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each pass; the best is kept")
    parser.add_argument("--chunk-rows", type=int, default=1024, help="loss chunk rows (the trainer's default)")
    parser.add_argument("--loss-child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--anchors", type=int, default=ANCHORS, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-only", action="store_true", help="measure ddp_scaling_2v1 alone")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.loss_child:
        print(json.dumps(loss_child(args.loss_child, args.anchors, args.chunk_rows)))
        return
    if args.smoke:
        args.rounds = 1
    ddp = (
        ddp_scaling(1, SMOKE_DDP_STEPS) if args.smoke else ddp_scaling(1 if args.quick else 2, 12 if args.quick else 24)
    )
    ddp_row = (
        "ddp_scaling_2v1 (sequences/s, 2 gloo ranks x 1 thread / 1 rank x 1 thread, global batch 8)",
        ">= 1.7",
        f"{ddp['ddp_scaling_2v1']} ({ddp['ddp_2rank_seq_per_s']} / {ddp['ddp_1rank_seq_per_s']} seq/s; "
        f"load average {ddp['ddp_load_avg'][0]} -> {ddp['ddp_load_avg'][1]} on {os.cpu_count()} cores); "
        f"two independent 1-rank fits side by side: {ddp['ddp_independent_pair_seq_per_s']} seq/s together, "
        f"so 2 ranks reach {ddp['ddp_2rank_vs_independent_pair']} of them",
    )
    if args.ddp_only:
        append_results("train_bench --ddp-only", [ddp_row], ddp, smoke=args.smoke)
        return

    if args.smoke:
        memory = loss_memory(SMOKE_NAIVE_ANCHORS, args.chunk_rows, SMOKE_ANCHORS)
    else:
        memory = loss_memory((64, 128) if args.quick else (64, 128, 192), args.chunk_rows)

    root = Path(tempfile.mkdtemp(prefix="train_bench_"))
    try:
        num_shards, per_shard = (2, 1) if args.smoke else (6, 2) if args.quick else (16, 4)
        stored_tokens = build_store(root / "store", num_shards, per_shard)
        from store_schema import Store

        store = Store(root / "store")
        # Alternate the two passes (cold, then warm) and keep each one's best round:
        # this 2-core machine is shared, and one slow round says nothing about the loader.
        cold_raw, cold_loader, warm_raw, warm_loader = [], [], [], []
        for _ in range(args.rounds):
            cache = drop_page_cache(root)
            cold_raw.append(raw_decode(store, args.threads))
            drop_page_cache(root)
            cold_loader.append(loader_pass(store, args.threads))
            warm_raw.append(raw_decode(store, args.threads))
            warm_loader.append(loader_pass(store, args.threads))
        raw_bytes, raw_s = min(cold_raw, key=lambda r: r[1])
        loader_bytes, loader_tokens, loader_s, wait_s = min(cold_loader, key=lambda r: r[2])
        warm_raw_bytes, warm_raw_s = min(warm_raw, key=lambda r: r[1])
        warm_bytes, _, warm_s, _ = min(warm_loader, key=lambda r: r[2])
    finally:
        shutil.rmtree(root, ignore_errors=True)

    raw_rate, loader_rate = raw_bytes / raw_s, loader_bytes / loader_s
    efficiency = loader_rate / raw_rate
    warm_efficiency = (warm_bytes / warm_s) / (warm_raw_bytes / warm_raw_s)
    tokens_per_s = loader_tokens / loader_s
    figures = {
        "loss_memory_ratio": round(memory["ratio"], 4),
        "loss_chunked_peak_gb": round(memory["chunked_bytes"] / 1e9, 3),
        "loss_naive_peak_gb": round(memory["naive_bytes"] / 1e9, 3),
        "loss_chunk_rows": args.chunk_rows,
        "loss_memory_method": memory["method"],
        "loader_efficiency": round(efficiency, 4),
        "loader_efficiency_warm": round(warm_efficiency, 4),
        "loader_mb_s": round(loader_rate / 1e6, 1),
        "raw_decode_mb_s": round(raw_rate / 1e6, 1),
        "loader_tokens_per_s": round(tokens_per_s),
        "seeds_trainer_tokens_per_s": SEEDS_TOKENS_PER_S,
        "loader_wait_s": round(wait_s, 3),
        "threads": args.threads,
        "rounds": args.rounds,
        "store_tokens": stored_tokens,
        "store_gb_raw": round(stored_tokens * len(LAYERS) * HIDDEN * 2 / 1e9, 2),
        "cache": cache,
        "quick": args.quick,
        "smoke": args.smoke,
        **ddp,
    }
    rows = [
        (
            "loss_memory_ratio (chunked / naive peak, V=248,320, 512x16)",
            "<= 0.15",
            f"{figures['loss_memory_ratio']} ({figures['loss_chunked_peak_gb']} / "
            f"{figures['loss_naive_peak_gb']} GB; {memory['method']})",
        ),
        (
            "loader_efficiency (loader / raw decode bytes/s, cold)",
            ">= 0.8",
            f"{figures['loader_efficiency']} ({figures['loader_mb_s']} / {figures['raw_decode_mb_s']} MB/s)",
        ),
        ("loader efficiency (warm)", "-", f"{figures['loader_efficiency_warm']}"),
        ddp_row,
        (
            "loader_tokens_per_s (5 x 5120 bf16, cold)",
            f"seeds' trainer used ~{SEEDS_TOKENS_PER_S:,} on one GPU",
            f"{figures['loader_tokens_per_s']:,} with {args.threads} decode threads",
        ),
    ]
    title = f"train_bench{' --quick' if args.quick else ''}: {figures['store_gb_raw']} GB raw, cache emptied by {cache}"
    append_results(title, rows, figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
