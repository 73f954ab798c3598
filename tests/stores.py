"""Stores of *real* hidden states for trainer tests: coding chats rendered with the
tiny tokenizer's chat template (loss mask = assistant tokens), run through the
tiny Qwen3 target with `extract.extraction.runner.TargetRunner`, written with the
`store_schema` writer. Tests may import both `extract` and `train`; the packages
never import each other."""

from __future__ import annotations

from pathlib import Path

import builders
import numpy as np

from store_schema import Fingerprint, SampleArrays, create_store, shard_name
from store_schema.dtypes import store_dtype


def chat_tokens(tokenizer, record: dict, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rendered = tokenizer.apply_chat_template(
        record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = np.asarray(rendered["input_ids"], dtype=np.int32)[:max_tokens]
    mask = np.asarray(rendered["assistant_masks"], dtype=np.uint8)[:max_tokens]
    return ids, mask


def build_real_store(
    path: Path,
    model_dir: Path,
    tokenizer,
    records: list[dict] | None = None,
    num_samples: int = 96,
    samples_per_shard: int = 8,
    layer_ids=(1, 3),
    max_tokens: int = 160,
    topk: int | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """A store of the tiny target's real hidden states for chat `records` (default:
    `num_samples` distinct coding chats, ids `sample-00000`...)."""
    from extract.extraction.runner import TargetRunner
    from extract.jobs.target import load_target

    target = load_target(model_dir)
    runner = TargetRunner(target, list(layer_ids), topk=topk, store_dtype=store_dtype(dtype))
    fingerprint = Fingerprint(
        target_model=str(model_dir),
        num_target_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        layer_ids=list(layer_ids),
        max_length=max_tokens,
        target_topk=topk or 0,
        dtype=dtype,
    )
    writer = create_store(path, fingerprint, builders.small_codec(dtype))
    records = records if records is not None else builders.coding_chats(num_samples)
    num_samples = len(records)
    for s, start in enumerate(range(0, num_samples, samples_per_shard)):
        batch = records[start : start + samples_per_shard]
        tokens = [chat_tokens(tokenizer, r, max_tokens) for r in batch]
        outputs = runner.run_batch([ids for ids, _ in tokens])
        samples = []
        for record, (ids, mask), out in zip(batch, tokens, outputs):
            sample = SampleArrays(record["id"], ids, mask, {layer: out[layer] for layer in layer_ids})
            if topk:
                sample.topk_ids = out["topk_ids"].numpy()
                sample.topk_logprobs = out["topk_logprobs"].numpy()
            samples.append(sample)
        writer.write_shard(shard_name(s), samples)
    return path


def repeated_corpus(num_samples: int, distinct: int, seed: int = 0) -> list[dict]:
    """`num_samples` chat records with unique ids drawing on only `distinct` different
    functions (sample i answers function i % distinct), the way a real corpus repeats
    common code. A tiny drafter trained for seconds cannot generalise to unseen code,
    but it can learn a corpus whose held-out samples share their content with
    training samples: that is what "it learns" measures end to end."""
    base = builders.coding_chats(distinct, seed=seed)
    return [{**base[i % distinct], "id": f"sample-{i:05d}"} for i in range(num_samples)]


def greedy_store(path, model_dir, tokenizer, layers, count: int, new_tokens: int):
    """A store whose responses are the target's own greedy continuations of coding
    prompts (what the drafter must predict at decode time), with real hidden states."""
    from extract.extraction.runner import TargetRunner
    from extract.jobs.target import load_target
    from store_schema import CodecConfig
    from train.decoding.speculate import greedy_generate

    target = load_target(model_dir)
    runner = TargetRunner(target, layers)
    fingerprint = Fingerprint(
        target_model=str(model_dir),
        num_target_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        layer_ids=list(layers),
        max_length=512,
        response_provenance="target",  # the target's own greedy replies, as `extract generate` records them
        response_sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "thinking": "keep"},
    )
    writer = create_store(path, fingerprint, CodecConfig(chunk_bytes=4096))
    records = builders.coding_chats(count)
    prompts = builders.chat_prompts(tokenizer, count, seed=0)
    for s, start in enumerate(range(0, count, 8)):
        rows = []
        for prompt in prompts[start : start + 8]:
            reply = greedy_generate(target.model, prompt, new_tokens, stop_ids=[]).tokens
            ids = np.asarray(prompt.tolist() + reply, dtype=np.int32)
            rows.append((ids, np.r_[np.zeros(len(prompt)), np.ones(len(reply))].astype(np.uint8)))
        outputs = runner.run_batch([ids for ids, _ in rows])
        samples = [
            SampleArrays(r["id"], ids, mask, {layer: out[layer] for layer in layers})
            for r, (ids, mask), out in zip(records[start : start + 8], rows, outputs)
        ]
        writer.write_shard(shard_name(s), samples)
    return path


def twin_stores(root: Path, model_dir: Path, tokenizer, dtype: str) -> tuple[Path, Path]:
    """The same chats' states of the tiny target in a bf16 and a `dtype` store (the
    runner quantizing on its device, as extraction does)."""
    kwargs = dict(records=repeated_corpus(24, 4), samples_per_shard=6, max_tokens=128)
    bf16 = build_real_store(root / "bf16", model_dir, tokenizer, **kwargs)
    return bf16, build_real_store(root / dtype, model_dir, tokenizer, dtype=dtype, **kwargs)
