"""Arithmetic both dry-runs (`extract plan --dry-run`, `train fit --dry-run`) share:
sizes of modules built on torch's meta device (no weights, no memory), what fits in
a GPU, and hours at a rate. GPU memory is counted in GiB (2**30 bytes), as
nvidia-smi and torch report it; store sizes stay SI (`units`)."""

from __future__ import annotations

import math

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def parameter_count(module) -> int:
    """Parameters of `module` (meta tensors count like real ones)."""
    return sum(p.numel() for p in module.parameters())


def largest_fitting(free_bytes: float, bytes_per_unit: float, multiple: int = 1) -> int:
    """The most units (e.g. tokens of a batch) that fit in `free_bytes`, rounded down
    to a multiple of `multiple`; 0 when not even one fits."""
    if free_bytes <= 0 or bytes_per_unit <= 0:
        return 0
    return int(free_bytes // bytes_per_unit) // multiple * multiple


def hours(work: float, rate_per_second: float) -> float:
    """`work` units at `rate_per_second`, in hours (inf at a zero rate)."""
    return work / rate_per_second / 3600 if rate_per_second > 0 else math.inf


HIGH_UTILISATION = 0.60  # of a GPU's dense bf16 peak: a sustained rate above it is rarely reached
DEFAULT_MFU = 0.4  # model FLOPs utilisation `fit --dry-run --gpu-tflops` assumes: a well-tuned dense bf16 run


def fits_in(peak_bytes: float, gpu_memory_gib: float) -> bool:
    """Does a peak of `peak_bytes` fit a GPU of `gpu_memory_gib` GiB (the one verdict both dry-runs give)?"""
    return peak_bytes <= gpu_memory_gib * GIB


def utilisation(tokens_per_s: float, flops_per_token: float, gpu_tflops: float) -> float:
    """The share of a GPU's peak (`gpu_tflops`, dense bf16) that `tokens_per_s` at
    `flops_per_token` needs: above HIGH_UTILISATION the rate is likely optimistic."""
    return tokens_per_s * flops_per_token / (gpu_tflops * 1e12)


def gib(count: float) -> float:
    return round(count / GIB, 2)


def epoch_traffic(store_bytes: int, cache_bytes: int, shard_bytes: int) -> int:
    """Bytes an epoch after the first fetches through a shard cache of `cache_bytes`
    (the policy of `train.data.cache`: shards pinned as far as they fit beside room for
    two streamed ones of up to `shard_bytes`; the rest is fetched every epoch)."""
    if store_bytes <= cache_bytes:
        return 0
    pinned = max(0, cache_bytes - 2 * shard_bytes)
    return store_bytes - min(pinned, store_bytes)


def sustained_rate(traffic_bytes: int, epoch_tokens: int, tokens_per_s: float) -> float:
    """Bytes/s the store must deliver to move `traffic_bytes` during an epoch of
    `epoch_tokens` trained at `tokens_per_s`."""
    return traffic_bytes * tokens_per_s / epoch_tokens if epoch_tokens else 0.0
