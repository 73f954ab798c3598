"""Which 4-bit format the fp4 store uses: block-scaled e2m1 codes with a power-of-two
scale per 32 or 16 values (MXFP4's shape, a scale that never saturates) against an
e4m3 scale per 32 or 16 values under a per-token power of two (NVFP4's shape), on a
real store's states: relative RMS error and bytes / raw bf16 after the store's
`channels` coding (zstd-1, a frame per byte column) of the packed codes, plus the
scales' zstd-1 bytes.

    python benchmarks/fp4_formats.py [--store demo_out/proxy-store] [--tokens 65536] [--smoke]

Prints one JSON line last: per format `relative_rms` and `bytes_ratio`, and `chosen`
(the store's format, `store_schema.codecs.fp4`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_smoke_flag, append_results, machine
from store_schema import CodecConfig
from store_schema.codecs.encoding import encode_shard
from store_schema.stores import open_store

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
FORMATS = {"pow2_32": ("pow2", 32), "pow2_16": ("pow2", 16), "e4m3_16": ("e4m3", 16), "e4m3_32": ("e4m3", 32)}
CHOSEN = "pow2_32"


def block_scales(blocks: np.ndarray, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(float32 scale per block, its stored bytes): the smallest power of two with
    max|x| / scale <= 6, or max|x| / 6 rounded up to e4m3 under a per-token power of two."""
    amax = np.abs(blocks).max(-1)
    if scale == "pow2":
        exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 6.0)), -127)
        return np.ldexp(1.0, exponent.astype(np.int32)).astype(np.float32), (exponent + 127).astype(np.uint8)
    token = np.ldexp(1.0, np.ceil(np.log2(np.maximum(amax.max(-1, keepdims=True), 1e-38) / 6.0 / 448.0)).astype(int))
    wanted = amax / 6.0 / token
    codes = wanted.astype(E4M3)
    bits = codes.view(np.uint8) + (codes.astype(np.float32) < wanted)  # round up: nothing saturates
    return (bits.view(E4M3).astype(np.float32) * token).astype(np.float32), bits.astype(np.uint8)


def measure(states: np.ndarray, scale: str, block: int) -> dict:
    tokens, hidden = states.shape
    blocks = states.reshape(tokens, hidden // block, block)
    scales, scale_bytes = block_scales(blocks, scale)
    safe = np.where(scales > 0, scales, 1.0)[..., None]
    codes = (blocks / safe).astype(E2M1).view(np.uint8).reshape(tokens, hidden) & 0xF
    restored = (codes.view(E2M1).astype(np.float32).reshape(blocks.shape) * scales[..., None]).reshape(tokens, hidden)
    packed = np.ascontiguousarray((codes[:, 0::2] | (codes[:, 1::2] << 4)).T).T  # channel-major, as from the device
    coded = sum(len(part) for part in encode_shard(packed, CodecConfig(name="channels")))
    coded += len(zstandard.ZstdCompressor(level=1).compress(scale_bytes.tobytes()))
    return {
        "relative_rms": round(float(np.linalg.norm(restored - states) / np.linalg.norm(states)), 4),
        "bytes_ratio": round(coded / (states.size * 2), 4),
    }


def store_states(path: str, tokens: int) -> dict[int, np.ndarray]:
    """float32 [tokens, H] of each layer, from the store's first shards."""
    store = open_store(path)
    parts: dict[int, list] = {layer: [] for layer in store.layer_ids}
    for name in store.committed_shards():
        data = store.read_shard(name)
        for layer in parts:
            parts[layer].append(data.states(layer))
        if sum(len(p) for p in parts[store.layer_ids[0]]) >= tokens:
            break
    return {layer: torch.cat(p)[:tokens].float().numpy() for layer, p in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="demo_out/proxy-store", help="a bf16 store of real states")
    parser.add_argument("--tokens", type=int, default=65_536, help="states per layer (default %(default)s)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # heavy-tailed channels, as a real residual stream's
        generator = np.random.default_rng(0)
        states = {1: (generator.standard_t(3, (512, 256)) * np.logspace(-1, 1, 256)).astype(np.float32)}
    else:
        states = store_states(args.store, args.tokens)
    formats = {}
    for name, (scale, block) in FORMATS.items():
        per_layer = [measure(values, scale, block) for values in states.values()]
        formats[name] = {key: round(float(np.mean([m[key] for m in per_layer])), 4) for key in per_layer[0]}
    figures = {
        "formats": formats,
        "chosen": CHOSEN,
        "store": None if args.smoke else args.store,
        "layers": len(states),
        "machine": machine(),
        "smoke": args.smoke,
    }
    rows = [
        (f"{name}: relative RMS error / bytes over raw bf16", "-", f"{f['relative_rms']} / {f['bytes_ratio']}")
        for name, f in formats.items()
    ]
    append_results(f"fp4_formats: {args.store}, {args.tokens} tokens a layer", rows, figures, smoke=args.smoke)


if __name__ == "__main__":
    main()
