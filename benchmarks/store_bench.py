"""Store vs per-sample torch.save files, side by side in one run: bytes on disk,
write speed, a shuffled epoch read cold (default bf16 codec, the v1 codec, and the
fp8 store), random 3072-token windows, decode GB/s per core of each codec, the
loader cores one GPU needs, and verify's speed. Object storage (a loopback
moto_server): the uploader's throughput (`extract run`'s bucket writer), the shard
cache's (`data.cache_dir`) fill rate from the bucket, the trainer's loader reading
six epochs through the cache after the one that filled it against the same store on
local disk, and the share of
`python -m train fit`'s time spent waiting for data (a tiny drafter) from the bucket
through a cache a first run filled, against the same run from local disk. The
writer's CPU per raw byte is measured twice: on these stores (one layer of 1,024
channels) and at the full job's shard geometry (`writer_geometry`: 5 layers x 5120),
from which `writer_cores_per_gpu_at_9000` comes.

    python benchmarks/store_bench.py [--quick | --smoke] [--workdir DIR]

Activations come from a small real transformers model (Qwen3, random weights)
run over Python standard-library source, not from noise. Prints one JSON line last."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import writer_geometry
from benchmarks.common import Timer, add_smoke_flag, append_results, drop_page_cache
from store_schema import (
    CodecConfig,
    Fingerprint,
    Plan,
    PlannedSample,
    PlannedShard,
    SampleArrays,
    Store,
    create_store,
    layout,
    on_disk_bytes,
    sample_digest,
    shard_name,
    store_dtype,
)
from store_schema.codecs.encoding import encode_shard
from store_schema.dtypes import QuantizedStates
from store_schema.plan import PlanSettings
from store_schema.runtime.host import available_cores
from store_schema.shard_decoder import read_arrays, start_sharded_decode
from store_schema.stores import open_store
from store_schema.tools.local_copy import copied_shards
from store_schema.tools.transcode import project_store
from train.families.dflash.anchors import has_anchor

HIDDEN = 1024
# The rate one seed GPU consumed: 36K tokens/s of 5 context layers x 5120 (Qwen3.6-27B).
GPU_TOKENS_PER_S, GPU_LAYERS, GPU_HIDDEN = 36_000, 5, 5120
EXTRACT_TOKENS_PER_S = 9_000  # what one GPU extracts of the 27B target at most: the writer's pace to keep
STORES = {  # name -> (codec, store dtype): every layout the writer makes, read side by side
    "bf16": (CodecConfig(), "bfloat16"),
    "bf16_blosc_v1": (CodecConfig(name="blosc"), "bfloat16"),
    "fp8": (CodecConfig(name=store_dtype("fp8_e4m3").default_codec), "fp8_e4m3"),  # v3, channels
    "fp8_bytesplit": (CodecConfig(), "fp8_e4m3"),  # fp8 codes row-major, one zstd frame a chunk
    "fp4": (CodecConfig(name=store_dtype("fp4_e2m1").default_codec), "fp4_e2m1"),  # packed e2m1, channels
    "bf16_raw": (CodecConfig(name="none"), "bfloat16"),
}


LOSSY_AND_DEFAULT = ("bf16", "fp8", "fp4")  # the stores whose writer and encoder rates are measured
PROJECT_ENERGY = 0.99  # the projected store's share of each layer's energy (`store_schema project`)


def _stored_bytes_per_value(dtype: str) -> float:
    return store_dtype(dtype).itemsize / store_dtype(dtype).values_per_code


def source_tokens() -> np.ndarray:
    """Byte values of stdlib source files: real text as token ids < 256."""
    import collections
    import email
    import json
    import logging
    import typing

    text = "".join(inspect.getsource(m) for m in (collections, email, json, logging, typing, inspect, argparse))
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)


def bench_model(seed: int = 0, layers: int = 2):
    """The small Qwen3 (random weights) whose layer 1 makes the activations."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=4096,
    )
    return Qwen3ForCausalLM(config).eval()


def make_activations(num_samples: int, seed: int = 0):
    """Yield (input_ids, hidden bf16 [T, HIDDEN]) of 1K-4K tokens from a small Qwen3."""
    model = bench_model(seed)
    tokens = source_tokens()
    rng = np.random.default_rng(seed)
    for _ in range(num_samples):
        length = int(rng.integers(1024, 4097))
        start = int(rng.integers(0, len(tokens) - length))
        ids = torch.from_numpy(tokens[start : start + length])[None]
        with torch.no_grad():
            hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states[2][0]
        yield ids[0].to(torch.int32).numpy(), hidden.to(torch.bfloat16)


def quantized(samples, dtype: str):
    """The samples as an fp8 / fp4 store's writer gets them: quantized on the device
    (here the CPU, untimed), only codes + scales handed over, the codes channel-major
    as `TargetRunner` lays them out on the device."""
    return [(ids, _channel_major(store_dtype(dtype).quantized(hidden))) for ids, hidden in samples]


def _channel_major(states: QuantizedStates) -> QuantizedStates:
    return QuantizedStates(states.codes.t().contiguous().t(), states.scales, states.values_per_code)


def encode_mb_s_per_core(samples, codec: CodecConfig, dtype: str, shard_tokens: int = 32768) -> float:
    """Raw bf16 MB/s one core turns into a store dtype's shard file bytes with their
    crc32c: the CPU seconds of `encode_shard` (one thread) + crc32c over each full
    `shard_tokens` shard of the samples (fp8: from channel-major codes quantized
    beforehand, as on a GPU)."""
    import google_crc32c  # the store's checksum, timed as the writer pays it

    values = torch.cat([h for _, h in samples])
    if store_dtype(dtype).scaled:
        values = store_dtype(dtype).lossy.quantize(values)[0]
    bits = values.view(torch.uint8 if values.element_size() == 1 else torch.int16).numpy()
    if codec.name == "channels":
        bits = np.ascontiguousarray(bits.T).T  # as the device hands codes over (see `quantized`)
    shard_tokens = min(shard_tokens, len(bits))  # --smoke holds less than one shard
    seconds = raw = 0
    for start in range(0, len(bits) - shard_tokens + 1, shard_tokens):
        shard = bits[start : start + shard_tokens]
        began = time.process_time()
        for part in encode_shard(shard, codec, threads=1):
            google_crc32c.value(part)
        seconds += time.process_time() - began
        raw += shard.size * 2
    return raw / seconds / 1e6


def match_table_saving(values: torch.Tensor, tokens: int = 32768) -> float:
    """The share of a bf16 shard's bytes (`tokens` of `values`) the level's own match
    table saves against the small one (`CodecConfig.match_table`)."""
    bits = values[:tokens].contiguous().view(torch.int16).numpy()
    size = {
        table: sum(len(part) for part in encode_shard(bits, CodecConfig(match_table=table)))
        for table in ("full", "small")
    }
    return round(1 - size["full"] / size["small"], 4)


def writer_cores_per_gpu(mb_s_per_core: float, tokens_per_s: int = EXTRACT_TOKENS_PER_S) -> float:
    """Cores that encode what one GPU extracts of the 27B target (5 layers x 5120) at `tokens_per_s`."""
    return round(tokens_per_s * GPU_LAYERS * GPU_HIDDEN * 2 / (mb_s_per_core * 1e6), 2)


def write_per_sample(root: Path, samples) -> float:
    root.mkdir(parents=True)
    with Timer() as t:
        for i, (ids, hidden) in enumerate(samples):
            path = root / f"{i:06d}.pt"
            with open(path, "wb") as f:
                torch.save(
                    {
                        "input_ids": torch.from_numpy(ids),
                        "loss_mask": torch.ones(len(ids), dtype=torch.uint8),
                        "hidden_states": hidden,
                    },
                    f,
                )
                f.flush()
                os.fsync(f.fileno())
    return t.seconds


def save_target(path: Path, seed: int = 0) -> Path:
    """The store's target as `train fit --target` reads it: `bench_model` with a third
    layer after its two (the fingerprint's 3 layers; layer 1's output is unchanged)."""
    small = bench_model(seed)
    target = bench_model(seed, layers=3)
    missing = target.load_state_dict(small.state_dict(), strict=False).missing_keys
    assert all(key.startswith("model.layers.2.") for key in missing), missing
    target.to(torch.bfloat16).save_pretrained(str(path))
    return path


def shard_samples(samples, shard_tokens: int) -> list[list[SampleArrays]]:
    """The samples dealt in order into shards of at least `shard_tokens` (the last: the rest)."""
    shards, shard, tokens = [], [], 0
    for i, (ids, hidden) in enumerate(samples):
        shard.append(SampleArrays(f"s{i:06d}", ids, np.ones(len(ids), np.uint8), {1: hidden}))
        tokens += len(ids)
        if tokens >= shard_tokens:
            shards.append(shard)
            shard, tokens = [], 0
    return shards + ([shard] if shard else [])


def bench_plan(shards: list[list[SampleArrays]], shard_tokens: int) -> Plan:
    """The plan `extract run` would have written for these shards (what a reader of a
    bucket store lists the shards from)."""
    planned, index = [], 0
    for s, shard in enumerate(shards):
        samples = []
        for x in shard:
            digest = sample_digest(x.input_ids.tobytes(), x.loss_mask.tobytes())
            samples.append(PlannedSample(x.sample_id, index, len(x.input_ids), int(x.loss_mask.sum()), digest))
            index += 1
        planned.append(PlannedShard(shard_name(s), tuple(samples)))
    settings = {**PlanSettings(max_length=4096, shard_tokens=shard_tokens).to_json(), "source": "store_bench"}
    return Plan(tuple(planned), settings=settings)


def write_store(
    root: Path, samples, shard_tokens: int, codec: CodecConfig, dtype: str, uploads: list | None = None
) -> tuple[float, float]:
    """(wall, CPU) seconds to write the samples' shards into a store at `root` (a
    directory or a bucket URL) after its plan; a bucket's writer appends each shard's
    `Upload` (bytes, seconds) to `uploads`."""
    fingerprint = Fingerprint(
        target_model="bench-qwen3",
        num_target_layers=3,
        hidden_size=HIDDEN,
        vocab_size=256,
        layer_ids=[1],
        max_length=4096,
        dtype=dtype,
    )
    writer = create_store(root, fingerprint, codec)
    shards = shard_samples(samples, shard_tokens)
    writer.write_plan(bench_plan(shards, shard_tokens))
    cpu = time.process_time()
    with Timer() as t:
        for index, shard in enumerate(shards):
            writer.write_shard(shard_name(index), shard)
            if uploads is not None:
                uploads.append(writer.upload_of(shard_name(index)))
    return t.seconds, time.process_time() - cpu


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
    shuffled through a buffer of a few shards (what the trainer's loader does).
    fp8 stores deliver codes + scales; the GPU dequantizes (not counted here)."""
    store = Store(root)
    names = store.committed_shards()
    rng = random.Random(seed)
    rng.shuffle(names)
    buffer, count = [], 0
    for data in store.iter_shards(names, threads=available_cores()):
        buffer.extend((data, i) for i in range(len(data)))
        while len(buffer) > buffer_shards * len(data):
            count += _take(buffer.pop(rng.randrange(len(buffer))))
    while buffer:
        count += _take(buffer.pop(rng.randrange(len(buffer))))
    return count


def _take(item) -> int:
    data, i = item
    start, stop = int(data.offsets[i]), int(data.offsets[i + 1])
    return data.hidden[1][start:stop].shape[0] > 0


def decode_gb_per_s_per_core(root: Path, repeats: int = 3) -> float:
    """The fast reader's chunk decode on one thread, files already in memory: GB/s of
    stored states out (bf16: 2 bytes a value; fp8: 1 byte, fp4: half a byte; scales not counted)."""
    store = Store(root)
    arrays = []
    for name in store.committed_shards():
        commit = store.commit(name)
        encoded = read_arrays(name, partial(store.shard_file, name), commit, [layout.layer_array(1)], verify=False)
        arrays.append((encoded[layout.layer_array(1)], commit.num_tokens))
    columns = store.dtype.stored_columns(store.fingerprint.layer_width(1))
    out_bytes = sum(tokens * columns * store.dtype.itemsize for _, tokens in arrays)
    times = []
    with ThreadPoolExecutor(1) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            for array, tokens in arrays:
                for future in start_sharded_decode(array, tokens, columns, pool)[1]:
                    future.result()
            times.append(time.perf_counter() - start)
    return out_bytes / statistics.median(times) / 1e9


def verify_gb_per_s(root: Path, checksums_only: bool = False) -> float:
    from store_schema.tools.verify import verify_store

    drop_page_cache(root)
    with Timer() as t:
        report = verify_store(root, checksums_only=checksums_only)
    assert report.ok, report.problems
    return on_disk_bytes(root) / t.seconds / 1e9


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


EPOCHS_AFTER_FILL = 6  # timed epochs of the loader after the one that fills the cache


def loader_epoch_seconds(store, shards: list[str], cache_dir=None) -> list[float]:
    """The trainer's loader (`train.data.loader.ShardLoader`) over `store`, through a
    fresh shard cache in `cache_dir` where given: the seconds of each epoch after the
    first (which filled the cache and warmed the page cache), each from the last sample
    of the one before; one sample and one shard of read-ahead. An epoch of the --quick
    store takes ~0.3 s, so one alone is mostly noise (0.6-1.5 between rounds): the
    ratio is taken over `EPOCHS_AFTER_FILL` of them."""
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader

    config = DataConfig(
        max_length=4096,
        heldout_fraction=0.0,
        buffer_shards=1,
        prefetch_samples=1,
        cache_dir=None if cache_dir is None else str(cache_dir),
    )
    epochs = EPOCHS_AFTER_FILL + 1
    spec = LoaderSpec([1], partial(has_anchor, 16), seed=1, epochs=epochs, shards=shards)
    loader = ShardLoader(store, config, spec, log=lambda line: None)
    ends = {}
    for sample in loader:
        ends[sample.epoch] = time.perf_counter()
    loader.close()
    return [ends[epoch] - ends[epoch - 1] for epoch in range(1, epochs)]


PAIRS = 5  # rounds of (local, through a fresh cache), the order alternating


def paired_epochs(local: Path, bucket, names: list[str], cache_dir: Path, cache_first: bool) -> tuple[list, list]:
    """(local, cached) epoch seconds (`loader_epoch_seconds`) of one round, back to back."""
    if cache_first:
        cached = loader_epoch_seconds(bucket, names, cache_dir)
        return loader_epoch_seconds(Store(local), names), cached
    return loader_epoch_seconds(Store(local), names), loader_epoch_seconds(bucket, names, cache_dir)


# The trainer's runs: the tests' tiny drafter (tests/tiny.py) on the bench target, one
# sample a step, no held-out pass, no evaluation, no checkpoint but the last.
FIT_SETS = (
    "model.num_hidden_layers=1",
    "model.block_size=8",
    "model.num_anchors=8",
    "model.architecture=dflash",
    "loss.position_weights=decay",
    "model.mask_token_id=0",
    "data.heldout_fraction=0",
    "data.max_length=4096",
    "train.batch_size=1",
    "train.grad_accumulation=1",
    "eval.every=0",
    "train.checkpoint_every=0",
)


# `train.data.cache.ShardCache.close`'s line: what a run found in the cache and what it fetched
CACHE_LINE = re.compile(r"(\d+) shard\(s\) reused after checking, (\d+) fetched")


def fit_records(target: Path, store, out: Path, steps: int, log_every: int, *sets: str) -> tuple[list[dict], str]:
    """The logged lines and the output of a `python -m train fit` of `steps` steps on
    `store`, with `sets` besides `FIT_SETS`. --skip-verify: the integrity pass would read
    the whole store before step 1 (from the bucket too), and it is not what is measured."""
    sets = (*FIT_SETS, f"train.log_every={log_every}", *sets)
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
        "--skip-verify",
        *sum((["--set", s] for s in sets), []),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"train fit on {store} failed:\n{done.stdout[-4000:]}")
    lines = (out / "train_log.jsonl").read_text().splitlines()
    shutil.rmtree(out)  # its checkpoint
    return [json.loads(line) for line in lines if line.strip()], done.stdout


def data_wait(run: tuple[list[dict], str], log_every: int) -> dict:
    """A run's (`fit_records`) data wait: the share of the trainer's time spent waiting
    for the loader over its logged intervals after the first (which holds the loader's
    start: its seconds of wait are given apart), and the mean seconds a step took
    there; through a cache, the shards it found there and those it fetched."""
    records, output = run
    records = [r for r in records if "loader_wait_frac" in r]  # the training lines
    seconds = [log_every / r["sequences_per_s"] for r in records]  # one sequence a step
    waited = [r["loader_wait_frac"] * s for r, s in zip(records, seconds)]
    steps = log_every * (len(records) - 1)
    cache = CACHE_LINE.search(output)
    return {
        "wait_share": round(sum(waited[1:]) / sum(seconds[1:]), 5),
        "step_s": round(sum(seconds[1:]) / steps, 3),
        "wait_s": round(sum(waited[1:]), 3),
        "first_interval_wait_s": round(waited[0], 3),
        **({"shards_reused": int(cache[1]), "shards_fetched": int(cache[2])} if cache else {}),
    }


def trainer_data_wait(work: Path, url: str, local: Path, steps: int) -> dict:
    """`train fit` from the bucket through a shard cache, twice: a first run fills the
    cache, the second reads it warm (what a restarted or multi-epoch job reads); then
    the same run from `local`. Each run's data wait (`data_wait`) over the same steps."""
    log_every = max(1, steps // 6)
    target = save_target(work / "target")
    bucket, cache = open_store(url), work / "fit_cache"
    names = bucket.committed_shards()
    size = sum(bucket.commit(name).disk_bytes for name in names)  # every shard pinned: the whole store fits
    through_cache = (f"data.cache_dir={cache}", f"data.cache_size={2 * size}")

    def run(store, out: str, *sets: str) -> dict:
        return data_wait(fit_records(target, store, work / out, steps, log_every, *sets), log_every)

    runs = {"cache_fill": run(url, "fit_fill", *through_cache)}
    held = copied_shards(cache)
    if sorted(held) != sorted(names):
        raise SystemExit(f"the first run left {len(held)} of {len(names)} shard(s) in {cache}: the cache is not warm")
    runs["cache"] = run(url, "fit_warm", *through_cache)
    runs["local"] = run(local, "fit_local")
    return {
        "trainer_data_wait_share_cache": runs["cache"]["wait_share"],
        "trainer_data_wait_share_local": runs["local"]["wait_share"],
        "trainer_data_wait_share_cache_fill": runs["cache_fill"]["wait_share"],
        "trainer_fit": {**runs, "steps": steps, "log_every": log_every, "store_shards": len(names)},
    }


def shard_cache_figures(work: Path, samples, local: Path, fit_steps: int) -> dict:
    """The same samples as the local store `local`, written to a bucket on a loopback
    moto_server by the writer `extract run`'s workers use (each shard built in a local
    spool, uploaded, marker last: the uploader's MB/s over the uploads alone); the cache
    filled from it shard by shard (MB/s of shard files, checked on arrival), then the
    epochs after the fill through the cache vs from `local` (the median ratio of
    `PAIRS` rounds; every epoch's seconds kept), and the trainer's data wait through
    a warm cache vs from `local` (`trainer_data_wait`)."""
    from benchmarks.common import loopback_s3, new_bucket
    from store_schema.tools.local_copy import copy_shard, open_local_copy

    with loopback_s3() as endpoint:
        url = f"s3://{new_bucket(endpoint)}/store"
        uploads = []
        write_store(url, samples, 32768, *STORES["bf16"], uploads=uploads)
        bucket = open_store(url)
        names = bucket.committed_shards()
        cache = work / "shard_cache"
        open_local_copy(cache, bucket)
        with Timer() as fill:
            copied = sum(copy_shard(bucket, cache, name) for name in names)
        runs = [paired_epochs(local, bucket, names, work / f"cache{i}", cache_first=i % 2 == 1) for i in range(PAIRS)]
        ratio = statistics.median(sum(r[0]) / sum(r[1]) for r in runs)
        local_s, cached_s = (statistics.median(sum(r[k]) for r in runs) for k in (0, 1))
        trainer = trainer_data_wait(work, url, local, fit_steps)
    sent, seconds = sum(u.sent for u in uploads), sum(u.seconds for u in uploads)
    return {
        "uploader_mb_s": round(sent / seconds / 1e6, 1),
        "shard_cache_fill_mb_s": round(copied / fill.seconds / 1e6, 1),
        "shard_cache_read_ratio_vs_local": round(ratio, 3),
        "shard_cache_epoch_seconds": {
            "cache": [[round(t, 3) for t in r[1]] for r in runs],
            "local": [[round(t, 3) for t in r[0]] for r in runs],
        },
        "loader_ms_per_sample": {
            "cache": round(1e3 * cached_s / EPOCHS_AFTER_FILL / len(samples), 1),
            "local": round(1e3 * local_s / EPOCHS_AFTER_FILL / len(samples), 1),
        },
        **trainer,
    }


def epoch_read_figures(work: Path, num_samples: int) -> tuple[str, dict]:
    """A shuffled epoch of the per-sample files and of each store, each from an empty
    page cache, back to back, then files and the bf16 store warm: (how the cache was
    emptied, samples/s and each store's ratio to the files)."""
    cold = drop_page_cache(work)
    with Timer() as t_files:
        n_files = read_epoch_per_sample(work / "files", seed=1)
    cold_s = {}
    for name in STORES:
        drop_page_cache(work)
        with Timer() as t:
            assert read_epoch_store(work / name, seed=1) == n_files == num_samples
        cold_s[name] = t.seconds
    with Timer() as t_files_warm:
        read_epoch_per_sample(work / "files", seed=2)
    with Timer() as t_store_warm:
        read_epoch_store(work / "bf16", seed=2)
    ratio = {name: round(t_files.seconds / cold_s[name], 3) for name in STORES}
    return cold, {
        "epoch_samples_s_store_cold": round(n_files / cold_s["bf16"], 2),
        "epoch_samples_s_torch_save_cold": round(n_files / t_files.seconds, 2),
        "epoch_read_ratio_vs_torch_save": ratio["bf16"],
        "fp8_epoch_read_ratio_vs_torch_save": ratio["fp8"],
        "fp8_bytesplit_epoch_read_ratio_vs_torch_save": ratio["fp8_bytesplit"],
        "fp4_epoch_read_ratio_vs_torch_save": ratio["fp4"],
        "blosc_v1_epoch_read_ratio_vs_torch_save": ratio["bf16_blosc_v1"],
        "raw_store_epoch_read_ratio_vs_torch_save": ratio["bf16_raw"],
        "epoch_read_ratio_vs_torch_save_warm": round(t_files_warm.seconds / t_store_warm.seconds, 3),
    }


def summary_rows(figures: dict) -> list[tuple[str, str, str]]:
    """The RESULTS.md table: (figure, goal, measured)."""
    return [
        ("bytes_ratio (default bf16 codec on disk / raw bf16)", "<= 0.70", str(figures["bytes_ratio"])),
        ("epoch_read_ratio_vs_torch_save (cold)", ">= 1.0", str(figures["epoch_read_ratio_vs_torch_save"])),
        ("fp8_bytes_ratio (fp8 store / raw bf16)", "<= 0.40", str(figures["fp8_bytes_ratio"])),
        ("fp8_epoch_read_ratio_vs_torch_save (cold)", "-", str(figures["fp8_epoch_read_ratio_vs_torch_save"])),
        (
            f"fp4 projected to {PROJECT_ENERGY} of the energy: bytes ratio / rank of {HIDDEN} / decode GB/s per core",
            "<= 0.19",
            f"{figures['fp4_projected_bytes_ratio']} / {figures['fp4_projected_rank']} / "
            f"{figures['fp4_projected_decode_gb_per_s_per_core']}",
        ),
        (
            "fp4_bytes_ratio (fp4 e2m1 store / raw bf16) / epoch read ratio (cold)",
            "<= 0.25",
            f"{figures['fp4_bytes_ratio']} / {figures['fp4_epoch_read_ratio_vs_torch_save']}",
        ),
        (
            "fp8 with the row-major codec (bytesplit): bytes ratio / epoch read ratio",
            "-",
            f"{figures['fp8_bytesplit_bytes_ratio']} / {figures['fp8_bytesplit_epoch_read_ratio_vs_torch_save']}",
        ),
        (
            "v1 codec (blosc): bytes ratio / epoch read ratio",
            "-",
            f"{figures['blosc_v1_bytes_ratio']} / {figures['blosc_v1_epoch_read_ratio_vs_torch_save']}",
        ),
        ("decode GB/s per core (stored bytes out)", "-", str(figures["decode_gb_per_s_per_core"])),
        ("loader cores for one GPU at 36K tok/s x 5 x 5120", "-", str(figures["loader_cores_for_36k_tok_s"])),
        (
            "verify_gb_per_s (on disk, all cores, cold)",
            "-",
            f"{figures['verify_gb_per_s']} (--checksums-only {figures['verify_checksums_only_gb_per_s']})",
        ),
        ("epoch read ratio (warm)", "-", str(figures["epoch_read_ratio_vs_torch_save_warm"])),
        (
            "write_mb_s (store, fsync; fp8 / fp4 from device-quantized codes)",
            "-",
            f"{figures['write_mb_s']} (fp8 {figures['fp8_write_mb_s']}, fp4 {figures['fp4_write_mb_s']}, "
            f"torch.save {figures['torch_save_write_mb_s']})",
        ),
        (
            "encode MB/s raw per core, crc32c included (bf16, fp8, fp4)",
            ">= 500",
            " / ".join(str(rate) for rate in figures["encode_mb_s_per_core"].values()),
        ),
        (
            "write MB/s raw per core: CPU seconds of the whole writer (stats, encode, files, crc32c)",
            "-",
            " / ".join(str(rate) for rate in figures["write_mb_s_per_core"].values()),
        ),
        (
            "... at the full job's shard geometry (32,768 tokens x 5 layers x 5120; `writer_geometry`)",
            "-",
            " / ".join(str(rate) for rate in figures["job_geometry_write_mb_s_per_core"].values()),
        ),
        (
            f"writer cores per GPU at {EXTRACT_TOKENS_PER_S} tokens/s x 5 x 5120 (bf16, fp8, fp4)",
            "<= 1",
            " / ".join(str(cores) for cores in figures["writer_cores_per_gpu_at_9000"].values()),
        ),
        (
            "... match_table small (what auto codes where the full table saves < 2 %; bf16, fp8, fp4)",
            "bf16 <= 0.8",
            " / ".join(str(cores) for cores in figures["writer_cores_per_gpu_at_9000_small_table"].values()),
        ),
        (
            "bytes the full match table saves on these bf16 states (auto keeps it from 2 %)",
            "info",
            str(figures["bf16_full_match_table_saving"]),
        ),
        (
            "random 3072-token window reads, store/files (cold)",
            "info",
            str(figures["window_read_ratio_vs_torch_save_cold"]),
        ),
        (
            "uploader MB/s (extract's bucket writer: shard files + marker, moto on loopback)",
            "-",
            str(figures["uploader_mb_s"]),
        ),
        ("shard cache fill MB/s (moto on loopback, crc32c checked)", "-", str(figures["shard_cache_fill_mb_s"])),
        (
            f"trainer's loader, {EPOCHS_AFTER_FILL} epochs after the fill through the shard cache / from local disk",
            ">= 0.9",
            str(figures["shard_cache_read_ratio_vs_local"]),
        ),
        (
            "train fit's data-wait share after the first fill: warm cache / local (first fill)",
            "<= 1 %",
            " / ".join(f"{100 * figures[f'trainer_data_wait_share_{run}']:.2f} %" for run in ("cache", "local"))
            + f" ({100 * figures['trainer_data_wait_share_cache_fill']:.2f} %)",
        ),
        (
            "train fit's seconds a step / the loader's alone a sample (ms): warm cache, local",
            "info",
            f"{figures['trainer_fit']['cache']['step_s']} / {figures['loader_ms_per_sample']['cache']}, "
            f"{figures['trainer_fit']['local']['step_s']} / {figures['loader_ms_per_sample']['local']}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="~200 MB instead of ~1 GB")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp dir on the same disk)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)
    num_samples = 8 if args.smoke else 80 if args.quick else 400

    work = Path(tempfile.mkdtemp(prefix="store_bench_", dir=args.workdir or Path(__file__).parent.parent))
    try:
        print(f"generating {num_samples} samples of activations ...", file=sys.stderr)
        samples = list(make_activations(num_samples))
        raw_bytes = sum(h.numel() * 2 for _, h in samples)
        write_files_s = write_per_sample(work / "files", samples)
        write_s, write_cpu_s = {}, {}
        for name, (codec, dtype) in STORES.items():
            given = quantized(samples, dtype) if store_dtype(dtype).scaled else samples
            write_s[name], write_cpu_s[name] = write_store(work / name, given, 32768, codec, dtype)
            del given
        encode = {
            dtype: round(encode_mb_s_per_core(samples, codec, dtype), 1)
            for codec, dtype in (STORES[name] for name in LOSSY_AND_DEFAULT)
        }
        print("the writer at the full job's shard geometry ...", file=sys.stderr)
        values = torch.cat([h for _, h in samples])
        geometry = dict(tokens=4096, layers=2, hidden=2 * HIDDEN) if args.smoke else {}
        job_write, job_write_small = (
            {
                STORES[name][1]: round(
                    writer_geometry.write_mb_s_per_core(
                        values, work / "job", STORES[name][1], match_table=table, **geometry
                    ),
                    1,
                )
                for name in LOSSY_AND_DEFAULT
            }
            for table in ("auto", "small")
        )
        full_table_saving = match_table_saving(values)
        del values
        disk = {name: on_disk_bytes(work / name) for name in STORES}
        print(f"the bf16 store projected to {PROJECT_ENERGY} of its energy, in fp4 ...", file=sys.stderr)
        projected = project_store(
            work / "bf16", work / "fp4_projected", energy=PROJECT_ENERGY, dtype="fp4_e2m1", log=lambda line: None
        )
        projected_figures = {
            "fp4_projected_bytes_ratio": round(on_disk_bytes(work / "fp4_projected") / raw_bytes, 4),
            "fp4_projected_rank": next(iter(projected["ranks"].values())),  # one rank for every layer
            "fp4_projected_energy_kept": round(min(projected["energy_kept"].values()), 4),
            "fp4_projected_decode_gb_per_s_per_core": round(decode_gb_per_s_per_core(work / "fp4_projected"), 3),
        }
        files_bytes = on_disk_bytes(work / "files")
        print("shard cache: a bucket on a loopback moto_server ...", file=sys.stderr)
        shard_cache = shard_cache_figures(work, samples, work / "bf16", 2 if args.smoke else 48 if args.quick else 96)
        del samples

        cold, reads = epoch_read_figures(work, num_samples)
        decode = {name: round(decode_gb_per_s_per_core(work / name), 3) for name in STORES}
        verify_rate = verify_gb_per_s(work / "bf16")
        checksum_rate = verify_gb_per_s(work / "bf16", checksums_only=True)
        windows_files, windows_store = random_windows(work / "files", work / "bf16", 4 if args.smoke else 40, seed=3)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gpu_values = GPU_TOKENS_PER_S * GPU_LAYERS * GPU_HIDDEN  # values per second one GPU consumes
    cores = {
        name: round(gpu_values * _stored_bytes_per_value(STORES[name][1]) / 1e9 / rate, 2)
        for name, rate in decode.items()
    }
    figures = {
        "raw_bytes": raw_bytes,
        "bytes_ratio": round(disk["bf16"] / raw_bytes, 4),
        "fp8_bytes_ratio": round(disk["fp8"] / raw_bytes, 4),
        "fp8_bytesplit_bytes_ratio": round(disk["fp8_bytesplit"] / raw_bytes, 4),
        "fp4_bytes_ratio": round(disk["fp4"] / raw_bytes, 4),
        "blosc_v1_bytes_ratio": round(disk["bf16_blosc_v1"] / raw_bytes, 4),
        "torch_save_bytes_ratio": round(files_bytes / raw_bytes, 4),
        "write_mb_s": round(raw_bytes / write_s["bf16"] / 1e6, 1),
        "fp8_write_mb_s": round(raw_bytes / write_s["fp8"] / 1e6, 1),
        "fp4_write_mb_s": round(raw_bytes / write_s["fp4"] / 1e6, 1),
        "torch_save_write_mb_s": round(raw_bytes / write_files_s / 1e6, 1),
        "encode_mb_s_per_core": encode,
        "write_mb_s_per_core": {
            STORES[name][1]: round(raw_bytes / write_cpu_s[name] / 1e6, 1) for name in LOSSY_AND_DEFAULT
        },
        "job_geometry_write_mb_s_per_core": job_write,
        "writer_cores_per_gpu_at_9000": {dtype: writer_cores_per_gpu(rate) for dtype, rate in job_write.items()},
        "job_geometry_write_mb_s_per_core_small_table": job_write_small,
        "writer_cores_per_gpu_at_9000_small_table": {
            dtype: writer_cores_per_gpu(rate) for dtype, rate in job_write_small.items()
        },
        "bf16_full_match_table_saving": full_table_saving,
        **reads,
        "decode_gb_per_s_per_core": decode,
        "loader_cores_for_36k_tok_s": cores,
        "verify_gb_per_s": round(verify_rate, 3),
        "verify_checksums_only_gb_per_s": round(checksum_rate, 3),
        "window_read_ratio_vs_torch_save_cold": round(windows_store / windows_files, 3),
        **shard_cache,
        **projected_figures,
        "cores": available_cores(),
        "cache": cold,
        "smoke": args.smoke,
    }
    append_results(
        f"store_bench{' --quick' if args.quick else ''}: {raw_bytes / 1e9:.2f} GB raw, cache emptied by {cold}",
        summary_rows(figures),
        figures,
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
