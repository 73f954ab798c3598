"""One store for several drafters: what reading a subset of a store's layers costs.

    python benchmarks/layers_bench.py [--quick | --smoke]

A store extracted with `--layers-from` two drafters holds the union of their taps
(9 layers for the published Qwen3.6-27B DFlash and DFlash 2); each drafter trains on
its own 5 (`model.target_layer_ids`). This measures the training loader reading 5
of 9 stored layers against the same samples in a store of exactly those 5, cold
page cache each time, best of `--rounds`. Appends a section to benchmarks/RESULTS.md
and prints one JSON line last:

- subset_bytes_ratio: bytes the loader read from storage (the process's `read_bytes`) from the 9-layer
  store over the 5-layer store's (goal <= 1.1);
- subset_cpu_ratio: the loader's CPU seconds (all threads) likewise (goal <= 1.1);
- bytes_read / cpu_seconds for each, the stores' bytes on disk."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from functools import partial

from benchmarks.common import add_smoke_flag, append_results, drop_page_cache
from train.families.dflash.anchors import has_anchor

DFLASH_TAPS = [1, 16, 31, 46, 61]  # the published Qwen3.6-27B DFlash
DFLASH2_TAPS = [5, 19, 33, 47, 61]  # the published DFlash 2
UNION = sorted(set(DFLASH_TAPS) | set(DFLASH2_TAPS))


def build_store(path: Path, layers: list[int], shards: int, samples: int, tokens: int, hidden: int) -> int:
    """The same random samples (seeded per sample) holding `layers`; bytes on disk."""
    from store_schema import CodecConfig, Fingerprint, SampleArrays, create_store, shard_name
    from store_schema.commit.records import on_disk_bytes

    fingerprint = Fingerprint(
        target_model="bench",
        num_target_layers=64,
        hidden_size=hidden,
        vocab_size=248_320,
        layer_ids=layers,
        max_length=tokens,
    )
    writer = create_store(path, fingerprint, CodecConfig())
    mask = np.ones(tokens, np.uint8)
    mask[: tokens // 4] = 0
    for s in range(shards):
        batch = []
        for i in range(samples):
            generator = torch.Generator().manual_seed(1000 * s + i)
            states = {layer: torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16) for layer in UNION}
            ids = np.random.default_rng(1000 * s + i).integers(0, 248_320, tokens).astype(np.int32)
            batch.append(SampleArrays(f"s{s}-{i}", ids, mask, {layer: states[layer] for layer in layers}))
        writer.write_shard(shard_name(s), batch)
    return on_disk_bytes(path)


def _read_bytes() -> int:
    """Bytes this process had read from storage (`read_bytes`: memory-mapped reads too,
    which `rchar` misses; the page cache is emptied before each pass)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def loader_read(path: Path, layers: list[int], threads: int) -> tuple[int, float]:
    """(bytes read, CPU seconds) of one cold epoch of the training loader over `layers`."""
    from store_schema import Store
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader

    drop_page_cache(path)
    data = DataConfig(max_length=4096, heldout_fraction=0.0, buffer_shards=2, loader_threads=threads)
    loader = ShardLoader(Store(path), data, LoaderSpec(layers, partial(has_anchor, 8), seed=0, epochs=1))
    before, cpu = _read_bytes(), time.process_time()
    samples = sum(1 for _ in loader)
    assert samples > 0
    return _read_bytes() - before, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 shards (8 otherwise), 2 rounds")
    parser.add_argument("--threads", type=int, default=2)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shards, samples, tokens, hidden, rounds = (
        (1, 1, 64, 256, 1) if args.smoke else (4, 2, 1024, 5120, 2) if args.quick else (8, 2, 2048, 5120, 3)
    )
    root = Path(tempfile.mkdtemp(prefix="layers_bench_"))
    try:
        disk = {
            "union": build_store(root / "union", UNION, shards, samples, tokens, hidden),
            "own": build_store(root / "own", DFLASH2_TAPS, shards, samples, tokens, hidden),
        }
        union = [loader_read(root / "union", DFLASH2_TAPS, args.threads) for _ in range(rounds)]
        own = [loader_read(root / "own", DFLASH2_TAPS, args.threads) for _ in range(rounds)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    union_bytes, own_bytes = min(b for b, _ in union), min(b for b, _ in own)
    union_cpu, own_cpu = min(c for _, c in union), min(c for _, c in own)
    figures = {
        "subset_bytes_ratio": round(union_bytes / own_bytes, 4),
        "subset_cpu_ratio": round(union_cpu / own_cpu, 4),
        "bytes_read": {"5_of_9": union_bytes, "5_of_5": own_bytes},
        "cpu_seconds": {"5_of_9": round(union_cpu, 3), "5_of_5": round(own_cpu, 3)},
        "store_bytes": disk,
        "stored_layers": {"5_of_9": UNION, "5_of_5": DFLASH2_TAPS},
        "rounds": rounds,
        "threads": args.threads,
    }
    rows = [
        (
            "loader bytes read, 5 of 9 stored layers / a 5-layer store",
            "<= 1.1",
            f"{figures['subset_bytes_ratio']} ({union_bytes / 1e6:.1f} / {own_bytes / 1e6:.1f} MB)",
        ),
        (
            "loader CPU seconds, the same",
            "<= 1.1",
            f"{figures['subset_cpu_ratio']} ({union_cpu:.2f} / {own_cpu:.2f} s, {args.threads} threads)",
        ),
    ]
    append_results("layers_bench: a drafter's layers out of a store for several", rows, figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
