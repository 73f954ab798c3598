"""The training job on paper (`python -m train fit --dry-run`), before any GPU time.

The drafter is planned by its family (`train.families.kinds`) and built on torch's
meta device from the run config and the target's config.json (no weights, no store
needed); per GPU:

- drafter weights, gradients and AdamW's two moments, all fp32 (`train.dtype` is an
  autocast dtype; weights and optimizer stay fp32); on more than one GPU the gradients
  are views into DDP's buckets (`gradient_as_bucket_view`), so the buckets add nothing;
- the frozen target head: `embed_tokens` + `lm_head` (one tensor when tied) in the
  autocast dtype;
- the loss chunk (`loss.chunk_rows` rows through the head): per chunk row and
  vocabulary entry, the fp32 logits, log-probs and gradient and one more such buffer
  (16 B, as measured);
- activations kept for backward, per sequence in flight (`train.batch_size`): the
  family's (`DrafterFamily.activation_bytes`; DFlash: `train.families.dflash.sizing`).

Steps per epoch: the samples over the global batch (`train.batch_size x
train.grad_accumulation`), which every GPU count shares out; the run's steps are
`train.max_steps` (`--max-steps`), else `train.epochs` of them. Its hours are the
tokens those steps read (steps x global batch x a sample's mean tokens: the store's,
or `data.max_length` as a bound without one) over the training rate x GPUs. The peak
is checked against `--gpu-memory` as `extract plan --dry-run` checks its own.

The rate comes from FLOPs (the family's `sample_flops`): a sample's training FLOPs over one GPU's
dense peak (`--gpu-tflops`) at a model FLOPs utilisation (`--mfu`, default
`DEFAULT_MFU`), or it is given (`--tokens-per-s`) and then checked against that peak:
a rate that needs more than the GPU's peak is refused as impossible."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from store_schema.runtime.estimate import DEFAULT_MFU, DTYPE_BYTES, fits_in, gib, hours, parameter_count
from train.families.kinds import family_named, family_of

FP32 = 4
# Per chunk row and vocabulary entry: fp32 logits, log-probs and gradient, and one more
# row-sized buffer (log_softmax's on CPU, the gradient's bf16 copy on a GPU). Measured on
# CPU at V = 248,320: 1.03 GB at 256 rows = 16.2 B (benchmarks/RESULTS.md, 2026-12-01).
LOSS_BYTES_PER_LOGIT = 16
# Below this many sequences per GPU per step, the step's fixed work (the optimizer's pass
# over fp32 weights and moments, the gradient all-reduce) is a large share of it.
MIN_SEQUENCES_PER_GPU = 4


def drafter_on_meta(drafter_config):
    with torch.device("meta"):
        return family_of(drafter_config).build(drafter_config)


@dataclass
class Sizing:
    """What `fit --dry-run` sizes the run for: GPUs, the epoch's samples (and the store's
    tokens: None takes samples as `data.max_length` long), and optionally one GPU's
    training rate, dense peak (TFLOP/s), utilisation and memory."""

    gpus: int = 1
    samples: int | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    gpu_tflops: float | None = None
    mfu: float = DEFAULT_MFU
    gpu_memory_gib: float | None = None


def training_rate(flops: dict, sequence_tokens: float, sizing: Sizing) -> dict:
    """Tokens/s of one GPU: `sizing.tokens_per_s`, or the FLOPs at `--gpu-tflops` x MFU;
    ValueError when the given rate needs more than the GPU's peak."""
    out = dict(flops_per_sample=flops["total"], tflop_per_sample=round(flops["total"] / 1e12, 3))
    if sizing.tokens_per_s is not None:
        needed = sizing.tokens_per_s / sequence_tokens * flops["total"] / 1e12
        out.update(tokens_per_s=sizing.tokens_per_s, tokens_per_s_rule="--tokens-per-s", needed_tflops=round(needed, 1))
        if sizing.gpu_tflops is not None and needed > sizing.gpu_tflops:
            raise ValueError(
                f"--tokens-per-s {sizing.tokens_per_s:g} is impossible: at "
                f"{flops['total'] / 1e12:.1f} TFLOP per {sequence_tokens:g}-token sample it needs "
                f"{needed:.0f} TFLOP/s per GPU, above --gpu-tflops {sizing.gpu_tflops:g} (the GPU's peak)"
            )
    elif sizing.gpu_tflops is not None:
        rate = sizing.gpu_tflops * 1e12 * sizing.mfu / flops["total"] * sequence_tokens
        out.update(
            tokens_per_s=round(rate, 1), tokens_per_s_rule=f"--gpu-tflops {sizing.gpu_tflops:g} at MFU {sizing.mfu:g}"
        )
    return out


def fit_estimate(config, target, drafter_config, sizing: Sizing) -> dict:
    """The figures `fit --dry-run` prints (bytes; GiB where named so), per GPU."""
    gpus, samples, tokens, gpu_memory_gib = sizing.gpus, sizing.samples, sizing.tokens, sizing.gpu_memory_gib
    family = family_of(drafter_config)
    drafter = drafter_on_meta(drafter_config)
    params = parameter_count(drafter)
    act = DTYPE_BYTES[config.train.dtype]
    state = dict(
        weights=params * FP32,
        gradients=params * FP32,
        adam_moments=2 * params * FP32,
        ddp_buckets=0,  # the gradients are the buckets' views
    )
    head_tensors = 1 if target.tie_word_embeddings else 2
    head = head_tensors * target.vocab_size * target.hidden_size * act
    loss_chunk = config.loss.chunk_rows * target.vocab_size * LOSS_BYTES_PER_LOGIT
    activations = family.activation_bytes(drafter_config, config.model, act, config.data.max_length)
    in_flight = config.train.batch_size * activations["bytes"]
    peak = sum(state.values()) + head + loss_chunk + in_flight
    global_batch = config.train.batch_size * config.train.grad_accumulation
    out = dict(
        drafter_parameters=params,
        **family.paper_figures(drafter),
        state_bytes=state,
        target_head_bytes=head,
        loss_chunk_rows=config.loss.chunk_rows,
        loss_chunk_bytes=loss_chunk,
        activations=activations,
        sequences_in_flight=config.train.batch_size,
        peak_gpu_bytes=peak,
        peak_gpu_gib=gib(peak),
        gpus=gpus,
        global_batch=global_batch,
        sequences_per_gpu_per_step=global_batch / gpus,
        dtype=config.train.dtype,
        **step_traffic(params, gpus, config.train.grad_allreduce),
    )
    if samples is not None:  # an epoch reads the training split only
        training = max(1, round(samples * (1 - config.data.heldout_fraction)))
        out.update(samples=samples, training_samples=training, steps_per_epoch=math.ceil(training / global_batch))
    if gpu_memory_gib is not None:
        out.update(gpu_memory_gib=gpu_memory_gib, fits=fits_in(peak, gpu_memory_gib))
    mean = mean_sample_tokens(config, samples, tokens)
    out.update(training_rate(family.sample_flops(drafter_config, config.model, mean), mean, sizing))
    out.update(run_length(config, out.get("steps_per_epoch"), samples, tokens, out.get("tokens_per_s"), gpus))
    return out


def step_traffic(params: int, gpus: int, allreduce: str) -> dict:
    """The bytes an optimizer step moves besides its sequences' compute: fused AdamW reads
    the fp32 weights, gradients and both moments and writes three of them back; DDP
    all-reduces every gradient once (a ring sends and receives 2 (n-1)/n of it per GPU)."""
    wire = 2 if allreduce == "bf16" else FP32
    gradients = params * wire if gpus > 1 else 0
    return dict(
        optimizer_bytes_per_step=7 * FP32 * params,
        allreduce_bytes_per_step=gradients,
        allreduce_dtype="bf16" if allreduce == "bf16" else "fp32",
        allreduce_wire_bytes_per_gpu=round(2 * (gpus - 1) / gpus * gradients),
    )


def mean_sample_tokens(config, samples: int | None, tokens: int | None) -> float:
    """A sample's mean tokens: the store's, or `data.max_length` (a bound) without one."""
    return tokens / samples if tokens and samples else config.data.max_length


def run_length(
    config, steps_per_epoch: int | None, samples: int | None, tokens: int | None, tokens_per_s: float | None, gpus: int
) -> dict:
    """The run's steps, the tokens they read and, at `tokens_per_s` per GPU, its hours
    ({} when neither --max-steps nor the samples give the steps)."""
    if config.train.max_steps is not None:
        total, rule = config.train.max_steps, "train.max_steps"
    elif steps_per_epoch is not None:
        total, rule = config.train.epochs * steps_per_epoch, f"{config.train.epochs} epochs"
    else:
        return {}
    mean = mean_sample_tokens(config, samples, tokens)
    read = round(total * config.train.batch_size * config.train.grad_accumulation * mean)
    out = dict(
        total_steps=total,
        total_steps_rule=rule,
        run_tokens=read,
        sample_tokens=round(mean, 1),
        sample_tokens_rule="the store's mean" if tokens and samples else "data.max_length (a bound)",
    )
    if tokens_per_s is not None:
        out.update(
            tokens_per_s=tokens_per_s,
            run_hours=round(hours(read, tokens_per_s * gpus), 3),
            gpu_hours=round(hours(read, tokens_per_s), 3),
        )
    return out


def estimate_lines(e: dict) -> list[str]:
    s, a, family = e["state_bytes"], e["activations"], family_named(e["architecture"])
    lines = [
        *family.paper_lines(e),
        f"per GPU     weights {gib(s['weights'])} + gradients {gib(s['gradients'])} + AdamW {gib(s['adam_moments'])}"
        " GiB (fp32; DDP's buckets are the gradients)",
        f"            target head {gib(e['target_head_bytes'])} GiB ({e['dtype']}); loss chunk {e['loss_chunk_rows']} "
        f"rows: {gib(e['loss_chunk_bytes'])} GiB",
        f"            activations {gib(a['bytes'] * e['sequences_in_flight'])} GiB ({e['sequences_in_flight']} "
        f"sequence(s) in flight: {family.activation_text(e)})",
        f"peak GPU    {e['peak_gpu_gib']} GiB per GPU on {e['gpus']} GPU(s); global batch {e['global_batch']} "
        f"({e['sequences_per_gpu_per_step']:g} per GPU per step)",
    ]
    lines += step_lines(e)
    if "fits" in e:
        lower = (
            "train.batch_size, loss.chunk_rows"
            if e["sequences_in_flight"] > 1
            else "loss.chunk_rows, or the drafter's positions (DFlash: model.num_anchors)"
        )
        lines.append(
            f"            {'fits' if e['fits'] else 'does NOT fit'} in {e['gpu_memory_gib']:g} GiB per GPU"
            + ("" if e["fits"] else f" (lower {lower}, or use a larger GPU)")
        )
    if "steps_per_epoch" in e:
        lines.append(
            f"epoch       {e['steps_per_epoch']} steps over the {e['training_samples']} training samples "
            f"(of {e['samples']}; the rest held out)"
        )
    if "total_steps" in e:
        lines.append(
            f"run         {e['total_steps']} steps ({e['total_steps_rule']}), {e['run_tokens']:,} tokens read "
            f"(samples of {e['sample_tokens']:g} tokens: {e['sample_tokens_rule']})"
        )
    lines.append(
        f"compute     {e['tflop_per_sample']:g} TFLOP per sample (forward and backward, frozen head included)"
        + (
            f"; {e['tokens_per_s']:g} tokens/s needs {e['needed_tflops']:g} TFLOP/s per GPU"
            if "needed_tflops" in e
            else ""
        )
    )
    if "run_hours" in e:
        lines.append(
            f"time        {e['run_hours']:.2f} h on {e['gpus']} GPU(s) at {e['tokens_per_s']:g} tokens/s each "
            f"({e['tokens_per_s_rule']}; {e['gpu_hours']:.1f} GPU-hours)"
        )
    else:
        lines.append("time        give --gpu-tflops (one GPU's dense bf16 peak, e.g. 989 for an H200) for the hours")
    return lines


def step_lines(e: dict) -> list[str]:
    """What a step moves besides its sequences, and a warning when that is much of the step."""
    lines = [
        f"per step    AdamW moves {gib(e['optimizer_bytes_per_step'])} GiB of GPU memory"
        + (
            f"; DDP all-reduces {gib(e['allreduce_bytes_per_step'])} GiB of {e['allreduce_dtype']} gradients "
            f"({gib(e['allreduce_wire_bytes_per_gpu'])} GiB over each GPU's link)"
            if e["gpus"] > 1
            else ""
        )
    ]
    if e["sequences_per_gpu_per_step"] < MIN_SEQUENCES_PER_GPU:
        lines.append(
            f"warning: each GPU trains {e['sequences_per_gpu_per_step']:g} sequence(s) a step, then waits on the "
            f"optimizer{' and the all-reduce' if e['gpus'] > 1 else ''}: fewer than {MIN_SEQUENCES_PER_GPU} leaves it "
            "idle for much of the step (raise train.grad_accumulation or train.batch_size, or use fewer GPUs)"
        )
    return lines
