"""benchmarks/store_text.py: the memorisability figures drafter_bench prints before it
ranks drafters, on stores whose answer is known."""

from __future__ import annotations

import sys

import numpy as np
import torch
from paths import REPO

from store_schema import Fingerprint, SampleArrays, create_store

sys.path.insert(0, str(REPO))
from benchmarks.store_text import reply_statistics


def _store(path, replies: list[np.ndarray]):
    """One shard: each sample a 4-token prompt (loss mask 0), then its reply (mask 1)."""
    fingerprint = Fingerprint(
        target_model="t", num_target_layers=4, hidden_size=8, vocab_size=512, layer_ids=[1], max_length=512
    )
    samples = []
    for i, reply in enumerate(replies):
        ids = np.concatenate([np.arange(500, 504), reply]).astype(np.int32)
        mask = np.concatenate([np.zeros(4), np.ones(len(reply))]).astype(np.uint8)
        hidden = {1: torch.randn(len(ids), 8).to(torch.bfloat16)}
        samples.append(SampleArrays(f"s{i}", ids, mask, hidden))
    create_store(path, fingerprint).write_shard("shard-000000", samples)
    return path


def test_replies_that_repeat_are_a_lookup_table(tmp_path):
    """Every sample the same reply: held-out replies are predicted and seen in full."""
    figures = reply_statistics(_store(tmp_path / "s", [np.arange(40)] * 60), heldout_fraction=0.3)
    assert figures["heldout_samples"] > 0
    assert figures["distinct_reply_tokens"] == 40 and figures["reply_tokens"] == 60 * 40
    assert figures["bigram_top1_heldout"] == 1.0
    assert figures["heldout_8gram_overlap"] == 1.0


def test_random_replies_are_not(tmp_path):
    """Replies of random tokens: a bigram table and 8-grams of training say ~nothing."""
    rng = np.random.default_rng(0)
    replies = [rng.integers(0, 500, 40) for _ in range(60)]
    figures = reply_statistics(_store(tmp_path / "s", replies), heldout_fraction=0.3)
    assert figures["bigram_top1_heldout"] < 0.1
    assert figures["heldout_8gram_overlap"] == 0.0
