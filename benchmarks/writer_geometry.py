"""The store writer's CPU at the full job's shard geometry (store_bench's writer figure).

store_bench's own stores are one layer of 1,024 channels: a shard there is 1/25 of the
bytes of a full-job shard (5 context layers x 5,120 of Qwen3.6-27B), so what the writer
pays once per shard or per layer (the zarr metadata, the small arrays, the commit
record, fsyncs) weighs 5-25x what it weighs in the job. Here the writer commits shards
of `JOB_TOKENS` tokens x `JOB_LAYERS` x `JOB_HIDDEN` made of the bench's real
activations (each 1,024-channel block of each layer taken from other tokens, so no
block repeats another), in 4,096-token samples; fp8 / fp4 codes are handed over channel-major
and quantized beforehand, as `TargetRunner` hands them from the device."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch

from store_schema import CodecConfig, Fingerprint, SampleArrays, create_store, shard_name, store_dtype
from store_schema.dtypes import QuantizedStates

JOB_TOKENS, JOB_LAYERS, JOB_HIDDEN = 32_768, 5, 5_120
SAMPLE_TOKENS = 4_096


def layer_states(values: torch.Tensor, tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """bf16 [tokens, hidden]: blocks of `values`' channels side by side, each from other tokens."""
    rng = np.random.default_rng(seed)
    blocks = []
    for _ in range(hidden // values.shape[1]):
        rows = (int(rng.integers(0, len(values))) + torch.arange(tokens)) % len(values)
        blocks.append(values[rows])
    return torch.cat(blocks, dim=1)


def shard_samples(values: torch.Tensor, dtype: str, shard: int, tokens: int, layers: int, hidden: int) -> list:
    """One shard's samples as the extraction worker hands them to the writer."""
    states = {}
    for layer in range(1, layers + 1):
        hidden_states = layer_states(values, tokens, hidden, seed=1000 * shard + layer)
        if store_dtype(dtype).scaled:
            codes, scales = store_dtype(dtype).lossy.quantize(hidden_states)
            states[layer] = (codes.t().contiguous(), scales)  # [columns, tokens]: the device's layout
        else:
            states[layer] = hidden_states
    samples = []
    for start in range(0, tokens, SAMPLE_TOKENS):
        part = slice(start, min(start + SAMPLE_TOKENS, tokens))
        hidden = {}
        for layer, held in states.items():
            if isinstance(held, tuple):
                hidden[layer] = QuantizedStates(held[0][:, part].t(), held[1][part], store_dtype(dtype).values_per_code)
            else:
                hidden[layer] = held[part]
        n = part.stop - part.start
        ids = (np.arange(n) % 256).astype(np.int32)
        samples.append(SampleArrays(f"j{shard}-{start}", ids, np.ones(n, np.uint8), hidden))
    return samples


def write_mb_s_per_core(
    values: torch.Tensor,
    root: Path,
    dtype: str,
    shards: int = 3,
    tokens: int = JOB_TOKENS,
    layers: int = JOB_LAYERS,
    hidden: int = JOB_HIDDEN,
    match_table: str = "auto",
) -> float:
    """Raw bf16 MB/s per CPU second of the writer committing `shards` shards of this
    geometry into a fresh store at `root` (the first shard untimed: it warms the writer),
    its codec's match finder `match_table` (`CodecConfig`)."""
    fingerprint = Fingerprint(
        target_model="bench-job-geometry",
        num_target_layers=layers + 2,
        hidden_size=hidden,
        vocab_size=256,
        layer_ids=list(range(1, layers + 1)),
        max_length=SAMPLE_TOKENS,
        dtype=dtype,
    )
    writer = create_store(
        root, fingerprint, CodecConfig(name=store_dtype(dtype).default_codec, match_table=match_table)
    )
    cpu = raw = 0.0
    try:
        for shard in range(shards):
            samples = shard_samples(values, dtype, shard, tokens, layers, hidden)
            began = time.process_time()
            writer.write_shard(shard_name(shard), samples)
            if shard:
                cpu += time.process_time() - began
                raw += tokens * layers * hidden * 2
            del samples
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return raw / cpu / 1e6
