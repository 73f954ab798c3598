"""Store vs per-sample torch.save files: bytes on disk, write speed, a shuffled
epoch read cold, and random 3072-token windows.

    python benchmarks/store_bench.py [--quick]

Activations come from a small real transformers model (Qwen3, random weights)
run over Python standard-library source, not from noise. Prints one JSON line last."""

from __future__ import annotations

import argparse
import inspect
import os
import random
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, append_results, drop_page_cache  # noqa: E402
from store_schema import (  # noqa: E402
    CodecConfig,
    Fingerprint,
    SampleArrays,
    Store,
    create_store,
    on_disk_bytes,
    shard_name,
)

HIDDEN = 1024


def source_tokens() -> np.ndarray:
    """Byte values of stdlib source files: real text as token ids < 256."""
    import collections
    import email
    import json
    import logging
    import typing

    text = "".join(inspect.getsource(m) for m in (collections, email, json, logging, typing, inspect, argparse))
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)


def make_activations(num_samples: int, seed: int = 0):
    """Yield (input_ids, hidden bf16 [T, HIDDEN]) of 1K-4K tokens from a small Qwen3."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2048, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)
    model = Qwen3ForCausalLM(config).eval()
    tokens = source_tokens()
    rng = np.random.default_rng(seed)
    for _ in range(num_samples):
        length = int(rng.integers(1024, 4097))
        start = int(rng.integers(0, len(tokens) - length))
        ids = torch.from_numpy(tokens[start : start + length])[None]
        with torch.no_grad():
            hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states[2][0]
        yield ids[0].to(torch.int32).numpy(), hidden.to(torch.bfloat16)


def write_per_sample(root: Path, samples) -> float:
    root.mkdir(parents=True)
    with Timer() as t:
        for i, (ids, hidden) in enumerate(samples):
            path = root / f"{i:06d}.pt"
            with open(path, "wb") as f:
                torch.save({"input_ids": torch.from_numpy(ids), "loss_mask": torch.ones(len(ids), dtype=torch.uint8),
                            "hidden_states": hidden}, f)
                f.flush()
                os.fsync(f.fileno())
    return t.seconds


def write_store(root: Path, samples, shard_tokens: int) -> float:
    fingerprint = Fingerprint(target_model="bench-qwen3", num_target_layers=3, hidden_size=HIDDEN, vocab_size=256,
                              layer_ids=[1], max_length=4096)
    writer = create_store(root, fingerprint, CodecConfig())
    with Timer() as t:
        shard, tokens, index = [], 0, 0
        for i, (ids, hidden) in enumerate(samples):
            shard.append(SampleArrays(f"s{i:06d}", ids, np.ones(len(ids), np.uint8), {1: hidden}))
            tokens += len(ids)
            if tokens >= shard_tokens:
                writer.write_shard(shard_name(index), shard)
                shard, tokens, index = [], 0, index + 1
        if shard:
            writer.write_shard(shard_name(index), shard)
    return t.seconds


def read_epoch_per_sample(root: Path, seed: int) -> int:
    files = sorted(root.iterdir())
    random.Random(seed).shuffle(files)
    count = 0
    with ThreadPoolExecutor(2) as pool:  # both cores, as a DataLoader with 2 workers would
        for sample in pool.map(lambda p: torch.load(p, weights_only=True), files):
            count += sample["hidden_states"].shape[0] > 0
    return count


def read_epoch_store(root: Path, seed: int, buffer_shards: int = 3) -> int:
    """Shards in random order, each read whole with parallel decode, samples
    shuffled through a buffer of a few shards (what the trainer's loader does)."""
    store = Store(root)
    names = store.committed_shards()
    rng = random.Random(seed)
    rng.shuffle(names)
    buffer, count = [], 0
    for data in store.iter_shards(names, threads=2):
        buffer.extend(data.sample(i) for i in range(len(data)))
        while len(buffer) > buffer_shards * len(data):
            sample = buffer.pop(rng.randrange(len(buffer)))
            count += sample.hidden[1].shape[0] > 0
    while buffer:
        count += buffer.pop(rng.randrange(len(buffer))).hidden[1].shape[0] > 0
    return count


def random_windows(per_sample: Path, store_root: Path, count: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    files = sorted(per_sample.iterdir())
    store = Store(store_root)
    locations = store.sample_locations()
    picks = [rng.randrange(len(files)) for _ in range(count)]
    drop_page_cache(per_sample, store_root)
    with Timer() as t_files:
        for k in picks:
            hidden = torch.load(files[k], weights_only=True)["hidden_states"]
            start = rng.randrange(max(1, hidden.shape[0] - 3072))
            hidden[start : start + 3072].clone()
    drop_page_cache(per_sample, store_root)
    with Timer() as t_store:
        for k in picks:
            name, i = locations[k]
            total = store.sample_length(name, i)
            start = rng.randrange(max(1, total - 3072))
            store.read_window(name, i, start, min(total, start + 3072), layers=[1])
    return count / t_files.seconds, count / t_store.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="~200 MB instead of ~1 GB")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir on the same disk)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    num_samples = 80 if args.quick else 400

    work = Path(tempfile.mkdtemp(prefix="store_bench_", dir=args.workdir or Path(__file__).parent.parent))
    try:
        print(f"generating {num_samples} samples of activations ...", file=sys.stderr)
        samples = list(make_activations(num_samples))
        raw_bytes = sum(h.numel() * 2 for _, h in samples)
        write_files_s = write_per_sample(work / "files", samples)
        write_store_s = write_store(work / "store", samples, shard_tokens=32768)
        files_bytes, store_bytes = on_disk_bytes(work / "files"), on_disk_bytes(work / "store")
        del samples

        cold = drop_page_cache(work)
        with Timer() as t_files:
            n_files = read_epoch_per_sample(work / "files", seed=1)
        drop_page_cache(work)
        with Timer() as t_store:
            n_store = read_epoch_store(work / "store", seed=1)
        with Timer() as t_files_warm:
            read_epoch_per_sample(work / "files", seed=2)
        with Timer() as t_store_warm:
            read_epoch_store(work / "store", seed=2)
        assert n_files == n_store == num_samples
        windows_files, windows_store = random_windows(work / "files", work / "store", 40, seed=3)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    figures = {
        "raw_bytes": raw_bytes,
        "bytes_ratio": round(store_bytes / raw_bytes, 4),
        "torch_save_bytes_ratio": round(files_bytes / raw_bytes, 4),
        "write_mb_s": round(raw_bytes / write_store_s / 1e6, 1),
        "torch_save_write_mb_s": round(raw_bytes / write_files_s / 1e6, 1),
        "epoch_samples_s_store_cold": round(n_store / t_store.seconds, 2),
        "epoch_samples_s_torch_save_cold": round(n_files / t_files.seconds, 2),
        "epoch_read_ratio_vs_torch_save": round((n_store / t_store.seconds) / (n_files / t_files.seconds), 3),
        "epoch_read_ratio_vs_torch_save_warm": round(t_files_warm.seconds / t_store_warm.seconds, 3),
        "window_read_ratio_vs_torch_save_cold": round(windows_store / windows_files, 3),
        "cache": cold,
    }
    rows = [
        ("bytes_ratio (store on disk / raw bf16)", "<= 0.72", str(figures["bytes_ratio"])),
        ("epoch_read_ratio_vs_torch_save (cold)", ">= 1.0", str(figures["epoch_read_ratio_vs_torch_save"])),
        ("epoch read ratio (warm)", "-", str(figures["epoch_read_ratio_vs_torch_save_warm"])),
        ("write_mb_s (store, fsync)", "-", f"{figures['write_mb_s']} (torch.save {figures['torch_save_write_mb_s']})"),
        ("random 3072-token window reads, store/files (cold)", "info", str(figures["window_read_ratio_vs_torch_save_cold"])),
    ]
    append_results(f"store_bench{' --quick' if args.quick else ''}: {raw_bytes / 1e9:.2f} GB raw, cache emptied by {cold}",
                   rows, figures)


if __name__ == "__main__":
    main()
