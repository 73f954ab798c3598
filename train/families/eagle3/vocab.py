"""EAGLE-3's draft vocabulary: the `draft_vocab_size` target tokens most often in
the replies of the store's training split (loss-mask positions of samples the run
does not hold out), as SpecForge builds it from its training data; ties go to the
lower token id, and a store with fewer distinct reply tokens fills up with the lowest
ids not yet taken. Read from the shards' token arrays only (no hidden states).

The engines read it as two tensors: `d2t` [draft vocab], offsets with target id =
draft id + d2t[draft id] (draft ids in increasing target-id order), and `t2d`
[vocab], true at the target ids drafted (vLLM ignores `t2d`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from train.data.heldout import is_heldout


def reply_token_counts(store, vocab_size: int, heldout_fraction: float, log: Callable[[str], None]) -> torch.Tensor:
    """[vocab_size] int64 counts of reply tokens over the training split."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    shards = store.committed_shards()
    for done, shard in enumerate(store.iter_shards(shards, layers=[]), 1):
        for row, sample_id in enumerate(shard.sample_ids):
            if is_heldout(sample_id, heldout_fraction):
                continue
            start, stop = int(shard.offsets[row]), int(shard.offsets[row + 1])
            tokens = shard.input_ids[start:stop].long()
            counts += torch.bincount(tokens[shard.loss_mask[start:stop].bool()], minlength=vocab_size)[:vocab_size]
        if done % 100 == 0 or done == len(shards):
            log(f"fit: draft vocabulary: counted the replies of {done}/{len(shards)} shards")
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size], t2d [vocab]) of the `size` most frequent ids of `counts`."""
    most = torch.sort(-counts, stable=True).indices[:size]  # ties: the lower id first
    chosen = most.sort().values
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(size), t2d


def fill_vocabulary(drafter, store, heldout_fraction: float, log: Callable[[str], None]) -> None:
    """A new run's draft vocabulary from the store, into the drafter's d2t / t2d."""
    config = drafter.config
    counts = reply_token_counts(store, config.vocab_size, heldout_fraction, log)
    d2t, t2d = draft_vocabulary(counts, config.draft_vocab_size)
    covered = int(counts[t2d].sum()) / max(int(counts.sum()), 1)
    log(
        f"fit: draft vocabulary: {config.draft_vocab_size:,} of {config.vocab_size:,} target tokens, "
        f"{covered:.1%} of the training split's reply tokens"
    )
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
