"""Small stores of random samples for the evaluation tests: two shards over layers
1 and 3 of the tiny Qwen3 target, and the eval section `train eval` builds by default."""

from __future__ import annotations

import numpy as np
import torch

from store_schema import Fingerprint, SampleArrays, Store, create_store
from train.evaluation.config import EvalConfig

LAYERS = [1, 3]


def everything(**fields) -> EvalConfig:
    """The eval section `python -m train eval` builds by default: every sample, every anchor."""
    return EvalConfig(**{"samples": None, "max_blocks_per_sample": None, **fields})


def make_samples(target, count=4, seed=0, full_mask=False):
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = int(rng.integers(40, 70))
        ids = rng.integers(0, target.vocab_size, length).astype(np.int32)
        mask = np.ones(length, np.uint8)
        if not full_mask:  # a prompt, a response, a second prompt, a second response
            mask[:8] = 0
            mask[25:31] = 0
        hidden = {
            layer: torch.randn(length, target.hidden_size, generator=generator).to(torch.bfloat16) for layer in LAYERS
        }
        samples.append(SampleArrays(f"sample-{seed}-{i}", ids, mask, hidden))
    return samples


def write_store(path, target, samples, topk=0):
    fingerprint = Fingerprint(
        target_model="tiny-qwen3",
        num_target_layers=target.num_hidden_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        layer_ids=LAYERS,
        max_length=128,
        target_topk=topk,
    )
    writer = create_store(path, fingerprint)
    writer.write_shard("shard-000000", samples[: len(samples) // 2])
    writer.write_shard("shard-000001", samples[len(samples) // 2 :])
    return Store(path)
