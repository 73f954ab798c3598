"""How memorisable a store's replies are: whether it can rank drafters at all.

A drafter comparison on replies that repeat themselves measures learning speed on a
lookup table, not drafting. Three figures over the reply tokens (loss mask 1), split
into training and held-out samples by the trainer's own rule (`is_heldout`):

- distinct_reply_tokens (and reply_tokens): the vocabulary the replies use;
- bigram_top1_heldout: a table of the training replies' next-token counts after each
  token predicts each held-out reply token from the token before it (top-1 share);
- heldout_8gram_overlap: the share of held-out reply 8-grams (all eight tokens in a
  reply) that occur verbatim in the training replies."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

NGRAM = 8


def samples(store_path: Path):
    """(sample id, input ids, loss mask) of every sample of a store, as numpy arrays."""
    from store_schema import Store

    store = Store(store_path)
    for name in store.committed_shards():
        shard = store.read_shard(name, layers=[])
        ids, mask = shard.input_ids.numpy(), shard.loss_mask.numpy()
        for i, sample_id in enumerate(shard.sample_ids):
            a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
            yield sample_id, ids[a:b], mask[a:b].astype(bool)


def reply_statistics(store_path: Path, heldout_fraction: float) -> dict:
    """The figures of the module docstring for the store at `store_path`."""
    from train.data.heldout import is_heldout

    following: dict[int, Counter] = defaultdict(Counter)
    seen_ngrams: set[tuple] = set()
    heldout, distinct, reply_tokens = [], set(), 0
    for sample_id, ids, mask in samples(store_path):
        reply = ids[mask]
        distinct.update(reply.tolist())
        reply_tokens += len(reply)
        if is_heldout(sample_id, heldout_fraction):
            heldout.append((ids, mask))
            continue
        for position in np.flatnonzero(mask[1:]) + 1:
            following[int(ids[position - 1])][int(ids[position])] += 1
        seen_ngrams.update(_ngrams(ids, mask))
    best_next = {token: counts.most_common(1)[0][0] for token, counts in following.items()}
    hits = total = overlap = ngrams = 0
    for ids, mask in heldout:
        for position in np.flatnonzero(mask[1:]) + 1:
            hits += best_next.get(int(ids[position - 1])) == int(ids[position])
            total += 1
        held = _ngrams(ids, mask)
        ngrams += len(held)
        overlap += sum(gram in seen_ngrams for gram in held)
    return {
        "reply_tokens": reply_tokens,
        "distinct_reply_tokens": len(distinct),
        "bigram_top1_heldout": round(hits / total, 3) if total else None,
        "heldout_8gram_overlap": round(overlap / ngrams, 3) if ngrams else None,
        "heldout_samples": len(heldout),
    }


def _ngrams(ids: np.ndarray, mask: np.ndarray) -> list[tuple]:
    """The `NGRAM`-grams whose tokens all lie in replies (loss mask 1)."""
    inside = np.convolve(mask.astype(np.int64), np.ones(NGRAM, np.int64), mode="valid") == NGRAM
    return [tuple(ids[start : start + NGRAM].tolist()) for start in np.flatnonzero(inside)]
