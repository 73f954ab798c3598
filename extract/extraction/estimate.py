"""The extraction job on paper (`python -m extract plan --dry-run`), before any GPU time.

From the target's config alone (the model built on torch's meta device: no weights
read, nothing allocated) and the plan:

- weights: what a worker loads, `embed_tokens` + decoder layers ``0..last context
  layer`` (`store_schema.runtime.target_model.load_target_model(keep_layers=...)`), in bf16 as on a GPU;
- activations per batch token: the widest transient of a decoder layer under
  `torch.inference_mode`, the MLP's: its input and normed input (2 x hidden) plus
  gate, up and act(gate) * up (3 x intermediate), bf16. Attention is taken to be a
  fused kernel (flash / SDPA, fla for linear attention: no tokens x tokens matrix);
- capture buffers: each context layer's output at the batch's tokens, bf16;
- a fixed reserve for the CUDA context, cuBLAS workspaces and allocator slack.

Weights + reserve + (activations + captures) x ``--batch-tokens`` is the peak per
worker, checked against ``--gpu-memory``; the largest token budget that fits is the
free memory over the per-token bytes. The job's hours are the plan's tokens over
``--tokens-per-s`` x ``--gpus``; writer cores per GPU are the raw bytes one GPU
produces per second over what one core of the writer handles for the store dtype
(`--store-dtype`; its measured rate, `StoreDtype.write_mb_s_per_core`); the job's
sustained write rate is those raw bytes x ``--gpus`` (and x the store's compression
ratio as written). With ``--gpu-tflops`` (one GPU's dense bf16 peak)
the rate is checked against the GPU: a forward pass costs 2 FLOPs per loaded
weight outside the embedding per token (attention's own tokens x tokens work is
left out, so this is a floor), and above 60 % of the peak the hours are likely
optimistic."""

from __future__ import annotations

import math

from store_schema.dtypes import STORE_DTYPES, store_dtype
from store_schema.layout import raw_bytes_per_token
from store_schema.runtime.estimate import (
    DTYPE_BYTES,
    GIB,
    HIGH_UTILISATION,
    epoch_traffic,
    fits_in,
    gib,
    hours,
    largest_fitting,
    parameter_count,
    sustained_rate,
    utilisation,
)
from store_schema.runtime.units import human_bytes

RUNTIME_RESERVE_GIB = 2.0  # CUDA context (~0.5), cuBLAS/attention workspaces, allocator fragmentation
BUDGET_MULTIPLE = 1024  # token budgets are reported rounded down to this
WEIGHT_DTYPE = "bfloat16"  # what a worker computes in on a GPU (`target_model.compute_dtype`)


def loaded_weights(model_dir: str, keep_layers: int) -> dict:
    """What a worker keeping decoder layers ``0..keep_layers-1`` holds, in bytes, by
    building that model on the meta device."""
    # torch and transformers only when a dry-run sizes a job: `--help` imports this module
    from transformers import AutoConfig

    from store_schema.runtime.target_model import headless_on_meta  # imports torch

    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    model = headless_on_meta(text, keep_layers)
    size = DTYPE_BYTES[WEIGHT_DTYPE]
    layers = [parameter_count(layer) * size for layer in model.layers]
    kinds = list(getattr(text, "layer_types", None) or ["decoder"] * text.num_hidden_layers)[:keep_layers]
    return dict(
        loaded_layers=keep_layers,
        embed_bytes=parameter_count(model.embed_tokens) * size,
        layer_bytes=sum(layers),
        layer_bytes_by_kind={kind: layers[kinds.index(kind)] for kind in dict.fromkeys(kinds)},
        weights_bytes=parameter_count(model) * size,
        hidden_size=int(text.hidden_size),
        intermediate_size=int(text.intermediate_size),
    )


def per_token_bytes(hidden: int, intermediate: int, num_context_layers: int) -> dict:
    size = DTYPE_BYTES[WEIGHT_DTYPE]
    return dict(activations=(2 * hidden + 3 * intermediate) * size, captures=num_context_layers * hidden * size)


def extraction_estimate(
    model_dir: str,
    layer_ids: list[int],
    plan_tokens: int,
    store_bytes: dict,
    batch_tokens: int,
    gpu_memory_gib: float | None,
    tokens_per_s: float | None,
    gpus: int,
    gpu_tflops: float | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """The figures `plan --dry-run` prints (bytes; GiB where named so)."""
    weights = loaded_weights(model_dir, layer_ids[-1] + 1)
    token = per_token_bytes(weights["hidden_size"], weights["intermediate_size"], len(layer_ids))
    per_token = token["activations"] + token["captures"]
    reserve = int(RUNTIME_RESERVE_GIB * GIB)
    peak = weights["weights_bytes"] + reserve + per_token * batch_tokens
    out = dict(
        weights,
        activation_bytes_per_token=token["activations"],
        capture_bytes_per_token=token["captures"],
        runtime_reserve_bytes=reserve,
        batch_tokens=batch_tokens,
        peak_gpu_bytes=peak,
        peak_gpu_gib=gib(peak),
        store_bytes=store_bytes,
        gpus=gpus,
    )
    if gpu_memory_gib is not None:
        free = gpu_memory_gib * GIB - weights["weights_bytes"] - reserve
        out.update(
            gpu_memory_gib=gpu_memory_gib,
            fits=fits_in(peak, gpu_memory_gib),
            largest_batch_tokens=largest_fitting(free, per_token, BUDGET_MULTIPLE),
        )
    if tokens_per_s is not None:
        raw_per_s = tokens_per_s * raw_bytes_per_token(weights["hidden_size"], len(layer_ids))
        out.update(
            tokens_per_s=tokens_per_s,
            job_hours=round(hours(plan_tokens, tokens_per_s * gpus), 3),
            gpu_hours=round(hours(plan_tokens, tokens_per_s), 3),
            store_dtype=dtype,
            writer_cores_per_gpu=writer_cores(raw_per_s, dtype),
            writer_cores_per_gpu_by_dtype={name: writer_cores(raw_per_s, name) for name in STORE_DTYPES},
            write_bytes_per_s=write_rates(raw_per_s * gpus, store_bytes),
        )
        if gpu_tflops is not None:
            flops = 2 * (weights["weights_bytes"] - weights["embed_bytes"]) // DTYPE_BYTES[WEIGHT_DTYPE]
            out.update(
                gpu_tflops=gpu_tflops,
                forward_flops_per_token=flops,
                gpu_utilisation=round(utilisation(tokens_per_s, flops, gpu_tflops), 3),
            )
    return out


def writer_cores(raw_per_s: float, dtype: str) -> int:
    """Whole cores that write `raw_per_s` raw bf16 bytes a second into a `dtype` store."""
    return math.ceil(raw_per_s / (store_dtype(dtype).write_mb_s_per_core * 1e6))


def write_rates(raw_per_s: float, store_bytes: dict) -> dict:
    """The job's sustained write rate to the store's filesystem: raw, and as each store dtype writes it."""
    raw = store_bytes["raw"] or 1
    return {
        "raw": round(raw_per_s),
        **{dtype: round(raw_per_s * size / raw) for dtype, size in store_bytes.items() if dtype != "raw"},
    }


def estimate_lines(e: dict) -> list[str]:
    """The dry-run's text for these figures."""
    kinds = ", ".join(f"{kind} {gib(size)} GiB" for kind, size in e["layer_bytes_by_kind"].items())
    lines = [
        f"worker      loads embed_tokens + decoder layers 0..{e['loaded_layers'] - 1}: {gib(e['weights_bytes'])} GiB "
        f"bf16 (embed {gib(e['embed_bytes'])}, layers {gib(e['layer_bytes'])}; one layer: {kinds})",
        f"peak GPU    {e['peak_gpu_gib']} GiB per worker at --batch-tokens {e['batch_tokens']}: weights + "
        f"{RUNTIME_RESERVE_GIB:g} reserve + {e['activation_bytes_per_token'] + e['capture_bytes_per_token']} B/token "
        f"(activations {e['activation_bytes_per_token']}, captures {e['capture_bytes_per_token']})",
    ]
    if "gpu_memory_gib" in e:
        verdict = "fits" if e["fits"] else "does NOT fit"
        lines.append(
            f"            {verdict} in {e['gpu_memory_gib']:g} GiB; the largest --batch-tokens that fits: "
            f"{e['largest_batch_tokens']}"
        )
    if "job_hours" in e:
        lines.append(
            f"job         {e['job_hours']:.2f} h on {e['gpus']} GPU(s) at {e['tokens_per_s']:g} tokens/s each "
            f"({e['gpu_hours']:.1f} GPU-hours); writer cores per GPU: {e['writer_cores_per_gpu']} "
            f"for {e['store_dtype']} (~{store_dtype(e['store_dtype']).write_mb_s_per_core:g} MB/s raw per "
            f"core; " + ", ".join(f"{name} {cores}" for name, cores in e["writer_cores_per_gpu_by_dtype"].items()) + ")"
        )
        rates = e["write_bytes_per_s"]
        lines.append(
            f"writes      {human_bytes(rates['raw'])}/s raw to the store's filesystem for "
            f"{e['job_hours']:.1f} h ({human_bytes(rates['bfloat16'])}/s compressed bf16, "
            f"{human_bytes(rates['fp8_e4m3'])}/s fp8)"
        )
    if "gpu_utilisation" in e:
        share = f"{e['gpu_utilisation']:.0%}"
        lines.append(
            f"GPU         {e['tokens_per_s']:g} tokens/s x {e['forward_flops_per_token'] / 1e9:.1f} "
            f"GFLOP/token is {share} of a {e['gpu_tflops']:g} TFLOPS GPU"
            + (
                f"; warning: above {HIGH_UTILISATION:.0%}, rarely sustained: the hours above are likely optimistic"
                if e["gpu_utilisation"] > HIGH_UTILISATION
                else ""
            )
        )
    return lines


def cache_traffic(store_bytes: dict, largest_shard_tokens: int, tokens: int, cache_bytes: int, rate) -> dict:
    """For training through a shard cache of `cache_bytes` (`data.cache_size`): per store
    dtype, what an epoch fetches from the store and the rate it must sustain at the
    job's training `rate` (a `TrainingRate`; `store_schema.runtime.estimate.epoch_traffic`)."""
    train_tokens_per_s = rate.tokens_per_s
    figures = {"cache_bytes": cache_bytes, "train_tokens_per_s": train_tokens_per_s, "train_rate_rule": rate.rule}
    for dtype, total in store_bytes.items():
        if dtype == "raw":
            continue
        shard = total * largest_shard_tokens // max(1, tokens)
        traffic = epoch_traffic(total, cache_bytes, shard)
        figures[dtype] = {
            "largest_shard_bytes": shard,
            "traffic_bytes_per_epoch": traffic,
            "bytes_per_s": round(sustained_rate(traffic, tokens, train_tokens_per_s)),
        }
    return figures


def cache_traffic_lines(figures: dict) -> list[str]:
    """`plan --dry-run`'s lines for `cache_traffic`."""
    lines = [
        f"cache       {human_bytes(figures['cache_bytes'])} per node, training at "
        f"{figures['train_tokens_per_s']:,.0f} tokens/s ({figures['train_rate_rule']})"
    ]
    for dtype in ("bfloat16", "fp8_e4m3"):
        entry = figures[dtype]
        lines.append(
            f"  {dtype:<10}{human_bytes(entry['traffic_bytes_per_epoch'])} per epoch from the store, "
            f"{human_bytes(entry['bytes_per_s'])}/s sustained"
        )
    return lines
