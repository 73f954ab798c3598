"""GPU check for sessions with a device: what the first GPU hour must learn, in one
short run (goal: under 8 minutes on an H200). `--smoke` runs the same code at tiny
sizes on a CPU, in the test suite (tests/extract/test_gpu_check.py), so the check cannot rot.

    python benchmarks/gpu_check.py [--smoke] [--phases kernels,train]

Every phase runs in order, caught and timed, and prints one flushed JSON line as it ends
(`phase`, `ok`, `error`, its figures), so a failure in one loses none of the others; a
phase whose input failed says so (`skipped`). The last line holds every figure and the
verdict: PASS (all ran and met the thresholds below), PARTIAL (what ran passed; some
part was skipped, with the reason), FAIL (a phase failed: exit 1).

Phases, each with its peak GPU memory (`peak_gpu_gb`, reset before each; None on CPU):

0. environment: versions, compute capability, GPU memory, shared memory per block.
1. kernels: the Qwen3.5 linear-attention layer's chunked gated delta rule and causal
   conv1d, the implementation transformers chose (fla / causal-conv1d) against its
   PyTorch fallback on the layer's shapes and gates; where the package is missing
   (always on CPU) that part is skipped with the reason, and the fallback still runs
   against the token-by-token recurrence.
2. attention: the drafter's flex attention (compiled on CUDA) against the split path,
   values and gradients, under training's autocast (flex has no backward on CPU:
   gradients there are skipped with the reason).
3. build: a Qwen3.5-architecture target (~2B at full size; vocabulary 248,320 in
   both modes) from a config, random weights, saved with a tokenizer.
4. extract: the project's own worker (`extract.extraction.worker.ExtractionWorker`, what each Ray
   actor runs), in-process: forward-only tokens/s, then the full extraction (forward +
   host copies + compression + checksums + commit) tokens/s and store GB/s; on CUDA the
   forward's peak memory at three token budgets, per token against the dry run's estimate.
5. loader: the streaming loader over the store, to the device through pinned memory
   on CUDA (`train.data.device_copy`): samples/s and feature GB/s.
6. train: a few optimizer steps at the real vocabulary; step timing leaves out the
   first `WARMUP_STEPS` (compilation), no evaluation runs; `train_compiled_graphs`
   counts what torch.compile built meanwhile (2 expected on CUDA: flex's two layer rules).
7. train_dflash2: the same steps for DFlash 2 (`model.architecture=dflash2`: block
   convolutions and the candidate selector's two V x 256 codebooks, its loss
   included), figures prefixed `train_dflash2_` with its parameters, recall@K and
   selector accuracy.

Between them: `ddp` (DDP as `fit` builds it, on one rank: gradients against the bare
module's, bf16 on the wire on CUDA, and an all-reduce's rate) and `extract_fp8` (the
extraction again, over the first 500 records, into an fp8 store with the target's top-8 (all
records and no top-k in --smoke), figures prefixed `fp8_`).
After them (benchmarks/gpu_check_decode.py): `speculate` on both kinds, `eval`'s offline
tau, and `serve_check` where vLLM imports (else skipped, and the verdict is PARTIAL).

Ray itself is not used (its wheel is larger than what travels to the device); the
worker is the same code. Prints one JSON line last."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import embedded  # noqa: E402

from benchmarks import gpu_check_decode as decode  # noqa: E402
from benchmarks.gpu_check_decode import decode_problems  # noqa: E402

REAL_VOCAB = 248_320
FULL = dict(
    hidden=2048,
    layers=24,
    heads=16,
    head_dim=128,
    vocab=REAL_VOCAB,
    records=4000,
    max_length=3072,
    shard_tokens=65536,
    batch_tokens=65536,
    train_steps=20,
    grad_accumulation=8,
    num_anchors=512,
    drafter_layers=5,
    kernel_tokens=4096,
    attention_context=3072,
    attention_anchors=512,
    selector_rank=256,
    decode_prompts=4,
    decode_tokens=64,
    eval_blocks=256,
    fp8_topk=8,
    fp8_records=500,  # of the 4000: the fp8 phase measures the codec and top-k, not the corpus again
    allreduce_mib=256,
)
SMOKE = dict(
    hidden=64,
    layers=6,
    heads=4,
    head_dim=16,
    vocab=REAL_VOCAB,
    records=24,
    max_length=256,
    shard_tokens=2048,
    batch_tokens=4096,
    train_steps=4,
    grad_accumulation=2,
    num_anchors=8,
    drafter_layers=1,
    kernel_tokens=96,
    attention_context=300,
    attention_anchors=12,
    selector_rank=32,
    decode_prompts=2,
    decode_tokens=8,
    eval_blocks=8,
    fp8_records=None,
    fp8_topk=None,  # the target's top-k over 248,320 entries a token: 20x the smoke's forward on a CPU core
    allreduce_mib=4,
)  # 2 codebooks x V x 32 fp32 + AdamW: ~0.5 GB of CPU memory, not 4
WARMUP_STEPS = 2  # step 1 compiles flex; step 2 is the first steady one on CPU noise (nothing recompiles)


@contextlib.contextmanager
def phase(figures: dict, name: str, device: str):
    """Time a phase and record its peak GPU memory (reset first)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    yield
    if device == "cuda":
        torch.cuda.synchronize()
    figures.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 2)
    peak = round(torch.cuda.max_memory_allocated() / 1e9, 3) if device == "cuda" else None
    figures.setdefault("peak_gpu_gb", {})[name] = peak


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().flatten(), b.float().flatten()
    return {
        "max_abs_diff": float((a - b).abs().max()),
        "cosine": round(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), 6),
    }


def check_kernels(size: dict, device: str) -> dict:
    """The chosen linear-attention / conv1d kernels against transformers' fallbacks."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from extract.jobs.kernels import kernel_implementations

    config = embedded.qwen3_5_config(1024, size["hidden"], 4, size["heads"], size["head_dim"])
    torch.manual_seed(0)
    layer = qwen.Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device)
    heads, dk, dv, tokens = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, size["kernel_tokens"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k = (torch.randn(1, tokens, heads, dk, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(1, tokens, heads, dv, device=device, dtype=dtype)
    beta = torch.rand(1, tokens, heads, device=device, dtype=dtype)
    a = torch.randn(1, tokens, heads, device=device)
    with torch.no_grad():
        g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a + layer.dt_bias.float())
        chosen, fallback = kernel_implementations(qwen.torch_chunk_gated_delta_rule)
        reference, _ = fallback(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        recurrent, _ = qwen.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        report = {"linear_attention_fallback_vs_recurrent": _compare(reference, recurrent)}
        if chosen is fallback:
            report["linear_attention_fla"] = "skipped: fla not importable here (the PyTorch fallback ran)"
        else:
            fast, _ = chosen(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            report["linear_attention_fla_vs_fallback"] = _compare(fast, reference)
        mixed = torch.randn(1, layer.conv_dim, tokens, device=device, dtype=dtype)
        conv_weight = layer.conv1d.weight.squeeze(1).to(dtype)
        chosen, fallback = kernel_implementations(qwen.causal_conv1d_fn)
        reference = fallback(mixed, conv_weight, None, activation=layer.activation)
        if chosen is fallback:
            report["causal_conv1d"] = "skipped: causal-conv1d not importable here (the PyTorch fallback ran)"
        else:
            report["causal_conv1d_vs_fallback"] = _compare(
                chosen(mixed, conv_weight, None, activation=layer.activation), reference
            )
    return report


def check_attention(size: dict, device: str) -> dict:
    """Flex (compiled on CUDA) against the split path: outputs, and on CUDA gradients."""
    import warnings

    from train.families.dflash.anchors import sample_anchors
    from train.families.dflash.model import DFlashDrafter, DrafterConfig

    config = DrafterConfig(
        hidden_size=size["hidden"],
        num_attention_heads=size["heads"],
        num_key_value_heads=max(1, size["heads"] // 2),
        head_dim=size["head_dim"],
        intermediate_size=2 * size["hidden"],
        vocab_size=4096,
        num_target_layers=8,
        context_layer_ids=[1, 3],
        mask_token_id=5,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=256,
        architecture="dflash",
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(device)
    embed = torch.nn.Embedding(4096, size["hidden"]).to(device)
    length = size["attention_context"]
    features = torch.randn(length, 2 * size["hidden"], device=device)
    ids = torch.randint(0, 4096, (length,), device=device)
    anchors = sample_anchors(
        torch.ones(length, dtype=torch.uint8, device=device),
        config.block_size,
        size["attention_anchors"],
        torch.Generator().manual_seed(0),
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    outputs, grads = {}, {}
    for kind in ("split", "flex"):
        drafter.zero_grad(set_to_none=True)
        backward = device == "cuda" or kind == "split"  # flex has no backward on CPU
        with autocast, torch.set_grad_enabled(backward), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
            out = drafter(features, ids, anchors, embed, attention=kind)
        if backward:
            out.float().square().mean().backward()
            grads[kind] = torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])
        outputs[kind] = out.detach()
    report = {"flex_vs_split": _compare(outputs["flex"], outputs["split"])}
    report["flex_vs_split_grads"] = (
        _compare(grads["flex"], grads["split"]) if "flex" in grads else "skipped: flex_attention has no backward on CPU"
    )
    return report


def build_target(path: Path, size: dict, device: str) -> None:
    from transformers import Qwen3_5ForCausalLM

    records = embedded.coding_chats(64)
    texts = [m["content"] for r in records for m in r["messages"]]
    embedded.build_tokenizer(path, texts, vocab_size=2048)
    config = embedded.qwen3_5_config(size["vocab"], size["hidden"], size["layers"], size["heads"], size["head_dim"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    del model


def extract(
    model: Path,
    corpus: Path,
    store: Path,
    size: dict,
    device: str,
    store_dtype: str = "bfloat16",
    topk: int | None = None,
    limit: int | None = None,
) -> dict:
    """The worker over the corpus (its first `limit` records), into a `store_dtype` store
    with the target's `topk` when asked."""
    from extract.extraction.layers import resolve_layer_ids
    from extract.extraction.planning import build_plan
    from extract.extraction.worker import ExtractionSpec, ExtractionWorker
    from extract.jobs.batching import batch_groups
    from extract.jobs.protocol import ShardFailed
    from store_schema import Fingerprint, Store, TargetFacts, create_store, on_disk_bytes, target_identity
    from store_schema.plan import PlanSettings

    plan = build_plan(
        str(corpus),
        str(model),
        PlanSettings(max_length=size["max_length"], shard_tokens=size["shard_tokens"], limit=limit),
    )
    layer_ids = resolve_layer_ids(str(model), None, 2 if size["layers"] < 8 else 5)
    worker = ExtractionWorker(
        ExtractionSpec(
            model=str(model),
            tokenizer=str(model),
            corpus=str(corpus),
            store=str(store),
            layer_ids=tuple(layer_ids),
            settings=plan.settings,
            device=device,
            batch_tokens=size["batch_tokens"],
            store_dtype=store_dtype,
            topk=topk,
        )
    )
    info = worker.info()
    facts = TargetFacts(
        num_target_layers=info.num_layers,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        kernels=info.kernels,
    )
    fingerprint = Fingerprint.for_extraction(
        target_identity(model), plan, layer_ids, facts, target_topk=topk or 0, dtype=store_dtype
    )
    create_store(store, fingerprint).write_plan(plan)
    groups = batch_groups([s.name for s in plan.shards], 2)
    worker.forward_only(groups[:1])  # warm-up: first-call allocations and kernel selection
    memory = forward_memory(worker, groups[:1], model, len(layer_ids), size, device) if topk is None else {}
    forward = worker.forward_only(groups)
    started = time.perf_counter()
    for group in groups:
        done = worker.extract_group(group, {name: None for name in group})
        failed = [reply for reply in done.replies if isinstance(reply, ShardFailed)]
        if failed:
            raise RuntimeError(f"extraction failed: {failed[0]}")
    seconds = time.perf_counter() - started
    tokens = Store(store).num_tokens()
    raw = tokens * len(layer_ids) * size["hidden"] * 2
    return {
        "tokens": tokens,
        "layers": layer_ids,
        "forward_only_tokens_per_s": round(forward.tokens / forward.seconds),
        "extract_tokens_per_s": round(tokens / seconds),
        "extract_over_forward": round(seconds / forward.seconds, 3),
        "store_write_gb_s": round(raw / seconds / 1e9, 4),
        "store_bytes_ratio": round(on_disk_bytes(store) / raw, 4),
        "kernels": info.kernels,
        **memory,
    }


def forward_memory(worker, groups: list, model: Path, layers: int, size: dict, device: str) -> dict:
    """The forward's peak GPU memory above the loaded weights at three token budgets, its
    growth per batch token, and that over what `extract plan --dry-run` counts per token
    (`extract.extraction.estimate.per_token_bytes`): the estimate's safety factor, measured.
    None on CPU (no allocator counters)."""
    from extract.extraction.estimate import per_token_bytes
    from store_schema.runtime.target_config import read_target_config

    if device != "cuda":
        return {"forward_bytes_per_token": None}
    budgets, peaks = [size["batch_tokens"] // 4, size["batch_tokens"] // 2, size["batch_tokens"]], {}
    for budget in budgets:
        worker.batch_tokens = budget
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        worker.forward_only(groups)
        peaks[budget] = torch.cuda.max_memory_allocated() - base
    worker.batch_tokens = size["batch_tokens"]
    per_token = (peaks[budgets[-1]] - peaks[budgets[0]]) / (budgets[-1] - budgets[0])
    config = read_target_config(model)
    estimate = sum(per_token_bytes(config.hidden_size, config.intermediate_size or 0, layers).values())
    return {
        "forward_peak_gb_by_batch_tokens": {str(b): round(p / 1e9, 3) for b, p in peaks.items()},
        "forward_bytes_per_token": round(per_token),
        "estimated_bytes_per_token": estimate,
        "forward_measured_over_estimate": round(per_token / estimate, 2),
    }


def loader_throughput(store: Path, device: str, block_size: int = 16) -> dict:
    """Every training sample of the store through the loader, to `device` (pinned
    host memory and a side stream on CUDA)."""
    from store_schema import Store
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader
    from train.families.dflash.anchors import has_anchor

    reader = Store(store)
    spec = LoaderSpec(list(reader.layer_ids), partial(has_anchor, block_size), seed=0, epochs=1, device=device)
    loader = ShardLoader(reader, DataConfig(), spec)
    started, samples, nbytes = time.perf_counter(), 0, 0
    for sample in loader:
        features = sample.context_features(device)
        samples, nbytes = samples + 1, nbytes + features.numel() * features.element_size()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "loader_samples_per_s": round(samples / seconds, 1),
        "loader_feature_gb_s": round(nbytes / seconds / 1e9, 4),
        "loader_pinned": device == "cuda",
        "loader_samples": samples,
    }


def train(model: Path, store: Path, out: Path, size: dict, architecture: str = "dflash") -> dict:
    """A few steps of `architecture`; DFlash 2's figures are prefixed `train_dflash2_`
    and add its parameters and the last step's selector metrics."""
    from train.config_loading import load_config
    from train.fitting.trainer import Trainer

    config = load_config(
        None,
        {
            "model.architecture": architecture,
            "model.selector_rank": size["selector_rank"],
            "model.num_hidden_layers": size["drafter_layers"],
            "model.num_anchors": size["num_anchors"],
            "data.max_length": size["max_length"],
            "train.log_every": 1,
            "eval.every": 0,  # 0: no evaluation at all
            "train.checkpoint_every": 0,
            "train.grad_accumulation": size["grad_accumulation"],
        },
        store=str(store),
        target=str(model),
        out=str(out),
        **{"train.max_steps": size["train_steps"]},
    )
    from torch._dynamo.utils import counters

    trainer = Trainer.from_config(config, log=lambda message: None)
    compiled = counters["frames"]["ok"]
    trainer.fit()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r][WARMUP_STEPS:]
    figures = {
        "train_vocab": trainer.head.lm_head.weight.shape[0],
        "train_steps_timed": len(steps),
        "train_tokens_per_s": round(sum(r["tokens_per_s"] for r in steps) / max(1, len(steps))),
        "train_loader_wait_frac": round(sum(r["loader_wait_frac"] for r in steps) / max(1, len(steps)), 4),
        "train_loss_finite": all(r["loss"] == r["loss"] for r in log if "loss" in r),
        # torch.compile graphs the steps made: flex's, one per layer rule (2 on CUDA: full and
        # sliding; train/families/dflash/flex_compile.py), 0 on CPU (the split path)
        "train_compiled_graphs": counters["frames"]["ok"] - compiled,
    }
    if architecture == "dflash":
        return figures
    last = [r for r in log if "loss" in r][-1]
    figures.update(
        parameters=sum(p.numel() for p in trainer.drafter.parameters()),
        recall_at_k=last.get("recall_at_k"),
        selector_acc=last.get("selector_acc"),
    )
    return {f"train_{architecture}_" + key.removeprefix("train_"): value for key, value in figures.items()}


def data_parallel(size: dict, device: str) -> dict:
    """DDP as `train fit` builds it (`train.fitting.distributed.data_parallel`: gradients as
    bucket views, and on CUDA the bf16 all-reduce hook auto picks between GPUs without
    NVLink), on one rank in-process: its gradients against the bare module's, and one
    all-reduce's rate. One rank crosses no link; a 2-GPU host's figure needs `fit --nproc 2`."""
    import os
    import socket

    import torch.distributed as dist

    from train.fitting.distributed import data_parallel as wrap_ddp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        width, where = size["hidden"], torch.device(device)
        layers = [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
        bare = torch.nn.Sequential(*layers).to(where)
        replica = wrap_ddp(copy.deepcopy(bare), where, "bf16" if device == "cuda" else "fp32")
        inputs = torch.randn(64, width, device=where)
        bare(inputs).square().mean().backward()
        replica(inputs).square().mean().backward()
        pairs = [(a.grad.flatten(), b.grad.flatten()) for a, b in zip(bare.parameters(), replica.parameters())]
        grads = _compare(torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs]))
        payload = torch.ones(size["allreduce_mib"] << 18, device=where)  # fp32
        dist.all_reduce(payload)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(payload)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / 5
        return {
            "ddp_check": {"grads_vs_bare": grads},
            "ddp_ranks": 1,
            "ddp_allreduce": "bf16" if device == "cuda" else "fp32",
            "ddp_allreduce_gb_s": round(payload.numel() * 4 / seconds / 1e9, 2),
        }
    finally:
        dist.destroy_process_group()


PHASES = (
    "environment",
    "kernels",
    "attention",
    "ddp",
    "build",
    "extract",
    "extract_fp8",
    "loader",
    "train",
    "train_dflash2",
    "speculate",
    "eval",
    "serve_check",
)
NEEDS = {
    "extract": "build",
    "extract_fp8": "build",
    "loader": "extract",
    "train": "extract",
    "train_dflash2": "extract",
    "speculate": "train",
    "eval": "train",
    "serve_check": "train",
}
# What a phase's figures must show to pass (on top of running without an error).
MIN_KERNEL_COSINE = 0.999  # fla / causal-conv1d against the PyTorch fallback (bf16 on CUDA)
MIN_FALLBACK_COSINE = 0.9999  # the chunked fallback against the token-by-token recurrence
MIN_FLEX_COSINE = 0.999  # flex against the split path, values and gradients (bf16 autocast on CUDA)
MIN_DDP_COSINE = 0.999  # DDP's gradients (bf16 on the wire on CUDA) against the bare module's


def environment(device: str) -> dict:
    """Versions, the device's compute capability, memory and shared memory per block."""
    import importlib.metadata

    from train.families.dflash.flex_compile import kernel_options

    def version(name: str):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    packages = ("torch", "transformers", "triton", "flash-linear-attention", "causal-conv1d", "zarr", "ray")
    report = {"python": sys.version.split()[0], "versions": {name: version(name) for name in packages}}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        report.update(
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            shared_memory_per_block_kb=getattr(props, "shared_memory_per_block_optin", 0) // 1024 or None,
            gpus=torch.cuda.device_count(),
            flex_tiles=kernel_options(torch.device("cuda")) or "flex's defaults",
        )
    return report


def problems(name: str, figures: dict) -> list[str]:
    """Why a phase that ran did not pass its thresholds (empty: it passed)."""
    found = []
    cosines = {
        "kernels": [
            ("linear_attention_fallback_vs_recurrent", MIN_FALLBACK_COSINE),
            ("linear_attention_fla_vs_fallback", MIN_KERNEL_COSINE),
            ("causal_conv1d_vs_fallback", MIN_KERNEL_COSINE),
        ],
        "attention": [("flex_vs_split", MIN_FLEX_COSINE), ("flex_vs_split_grads", MIN_FLEX_COSINE)],
        "ddp": [("grads_vs_bare", MIN_DDP_COSINE)],
    }
    checks = figures.get(f"{name}_check", {})
    for key, floor in cosines.get(name, []):
        if isinstance(checks.get(key), dict) and not checks[key]["cosine"] >= floor:
            found.append(f"{key} cosine {checks[key]['cosine']} < {floor}")
    if name.startswith("train") and figures.get(f"{name}_loss_finite") is False:
        found.append("the training loss is not finite")
    if name in ("speculate", "serve_check"):
        found += decode_problems({key: figures[key] for key in (f"{name}_check", name) if key in figures})
    return found


def skipped_parts(figures: dict) -> list[str]:
    """Parts a phase skipped, with their reason ("skipped: ..." values)."""
    checks = [figures.get(key, {}) for key in ("kernels_check", "attention_check", "speculate_check")]
    checks.append({"serve_check": figures.get("serve_check")})
    return [
        f"{key}: {value.removeprefix('skipped: ')}"
        for check in checks
        for key, value in check.items()
        if isinstance(value, str) and value.startswith("skipped: ")
    ]


def run_phase(name: str, body, figures: dict, device: str, done: dict) -> None:
    """Run one phase, caught and timed; one flushed JSON line as it ends."""
    line: dict = {"phase": name}
    need = NEEDS.get(name)
    if need and not done.get(need):
        line.update(ok=False, error=None, skipped=f"needs the {need} phase, which did not pass")
    else:
        try:
            with phase(figures, name, device):
                found = body() or {}
            figures.update(found)
            issues = problems(name, figures)
            line.update(ok=not issues, error="; ".join(issues) or None, **found)
        except Exception as error:  # every phase reports, whatever breaks in it
            line.update(ok=False, error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        line.update(seconds=figures.get("seconds", {}).get(name), peak_gpu_gb=figures.get("peak_gpu_gb", {}).get(name))
    done[name] = line["ok"]
    figures.setdefault("phases", {})[name] = {k: line.get(k) for k in ("ok", "error", "skipped")}
    print(json.dumps(line, default=str), flush=True)


def verdict(figures: dict, chosen: list[str]) -> dict:
    """PASS: every phase ran and passed; PARTIAL: those that ran passed, some part was
    skipped (a kernel not installed, a phase not chosen); FAIL: a phase failed."""
    phases = figures.get("phases", {})
    failed = {name: row["error"] or row["skipped"] for name, row in phases.items() if not row["ok"]}
    skipped = skipped_parts(figures) + [f"{name}: not chosen (--phases)" for name in PHASES if name not in chosen]
    result = "FAIL" if failed else "PARTIAL" if skipped else "PASS"
    return {
        "verdict": result,
        "failed": failed,
        "skipped": skipped,
        "thresholds": {
            "kernel_cosine": MIN_KERNEL_COSINE,
            "fallback_cosine": MIN_FALLBACK_COSINE,
            "flex_cosine": MIN_FLEX_COSINE,
            "ddp_cosine": MIN_DDP_COSINE,
            "speculate": "lossless, or near ties only in bf16 (train speculate's rule)",
        },
    }


def chosen_phases(text: str | None) -> list[str]:
    """--phases a,b: those phases and the ones they need, in order."""
    if not text:
        return list(PHASES)
    wanted = {name.strip() for name in text.split(",") if name.strip()}
    unknown = wanted - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: no phase {', '.join(sorted(unknown))} (phases: {', '.join(PHASES)})")
    for name in list(wanted):
        while NEEDS.get(name):
            name = NEEDS[name]
            wanted.add(name)
    return [name for name in PHASES if name in wanted]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU is fine)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--phases", help=f"comma-separated, with what they need (default all: {', '.join(PHASES)})")
    args = parser.parse_args(argv)
    chosen = chosen_phases(args.phases)
    size = SMOKE if args.smoke else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=args.workdir))
    figures: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "smoke": args.smoke}
    corpus = work / "corpus.jsonl"

    def corpus_file() -> Path:
        return corpus if corpus.is_file() else embedded.write_jsonl(corpus, embedded.coding_chats(size["records"]))

    started, done = time.perf_counter(), {}
    bodies = {
        "environment": lambda: {"environment": environment(device)},
        "kernels": lambda: {"kernels_check": check_kernels(size, device)},
        "attention": lambda: {"attention_check": check_attention(size, device)},
        "build": lambda: build_target(work / "target", size, device),
        "ddp": lambda: data_parallel(size, device),
        "extract": lambda: extract(work / "target", corpus_file(), work / "store", size, device),
        "extract_fp8": lambda: {
            f"fp8_{key}": value
            for key, value in extract(
                work / "target",
                corpus_file(),
                work / "store-fp8",
                size,
                device,
                "fp8_e4m3",
                size["fp8_topk"],
                size["fp8_records"],
            ).items()
        },
        "loader": lambda: loader_throughput(work / "store", device),
        "train": lambda: train(work / "target", work / "store", work / "run", size),
        "train_dflash2": lambda: train(work / "target", work / "store", work / "run-dflash2", size, "dflash2"),
        "speculate": lambda: decode.speculate(
            {
                "dflash": (work / "run", []),
                "dflash_rerun": (work / "run", ["--rollback", "rerun"]),
                "dflash2": (work / "run-dflash2", [])
                if done.get("train_dflash2")
                else "skipped: train_dflash2 did not pass",
            },
            work / "target",
            work / "store",
            size,
        ),
        "eval": lambda: decode.offline_eval(work / "run", work / "target", work / "store", size),
        "serve_check": lambda: decode.serve_check(work / "run", work / "target", work / "store", size),
    }
    try:
        for name in chosen:
            run_phase(name, bodies[name], figures, device, done)
        figures["wall_s"] = round(time.perf_counter() - started, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures.update(verdict(figures, chosen))
    print(json.dumps(figures, default=str), flush=True)
    return figures


if __name__ == "__main__":
    sys.exit(1 if main()["verdict"] == "FAIL" else 0)
