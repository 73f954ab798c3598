"""Acceptance evaluation of a drafter on stored samples: tau, DDTree acceptance,
per-position and top-1/4/8 accuracy.

Blocks are anchored throughout each response: every position a training anchor
could take (`loss_mask == 1` and `a <= len - B`, `train.anchors.anchor_candidates`),
or every `anchor_stride`-th of them. Each block is drafted exactly as in training
(context features strictly before the anchor, `[anchor, MASK x (B-1)]`), then its
slots 1..B-1 are scored through the target's frozen lm_head and compared with the
reference continuation:

- labels="tokens": the stored tokens `input_ids[a + k]` (what was written);
- labels="target": the target's greedy prediction for each position, the top-1 of
  the store's recorded top-k (`topk_ids[a + k - 1, 0]`). Teacher-forced: slot k's
  reference is the target's choice given the *stored* prefix, which equals its
  greedy continuation from the anchor whenever the earlier slots agree with the
  stored tokens.

Metrics are defined in `train/acceptance.py`. tau and DDTree acceptance are
averaged per sample, then over samples (z-lab's benchmark averages per response);
accuracies are pooled over all scored slots.

What to evaluate and how is the run's `eval` section (`train.config.EvalConfig`:
DDTree budgets, labels, anchor stride, blocks per sample, batch size); which
samples are held out is the loader's rule (`train.loader.is_heldout`) at the
run's own fraction. The training loop evaluates through `train.evaluators`
(`AcceptanceEval`); `python -m train eval` (train/cli/eval.py) calls `evaluate`
and presents the result.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from train.acceptance import (
    accuracy_counts,
    chain_acceptance,
    ddtree_acceptance,
    scored_blocks,
    topk_hits,
)
from train.anchors import anchor_candidates
from train.config import SPLITS, EvalConfig
from train.loader import is_heldout
from train.loss import block_targets


def in_split(sample_id: str, split: str, heldout_fraction: float | None) -> bool:
    """Whether a sample belongs to `split` of a run that held out `heldout_fraction`."""
    if split == "all":
        return True
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if heldout_fraction is None or not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"split {split!r} needs the run's held-out fraction in [0, 1], got {heldout_fraction!r}")
    return is_heldout(sample_id, heldout_fraction) == (split == "heldout")


def store_samples(
    store,
    layers: Sequence[int],
    split: str,
    heldout_fraction: float | None,
    max_samples: int | None = None,
    need_topk: bool = False,
) -> Iterator:
    """Samples of `split` in store order (shards sorted, samples in shard order),
    reading whole shards with only `layers`. Stops after `max_samples`."""
    from store_schema import Store

    if not isinstance(store, Store):
        store = Store(store)
    layers = store.require_layers(list(layers))
    in_split("", split, heldout_fraction)  # refuse a bad split before reading anything
    taken = 0
    if max_samples is not None and max_samples <= 0:
        return
    for shard in store.iter_shards(store.committed_shards(), layers=layers):
        for i, sample_id in enumerate(shard.sample_ids):
            if not in_split(sample_id, split, heldout_fraction):
                continue
            sample = shard.sample(i)
            if need_topk and sample.topk_ids is None:
                raise ValueError(
                    f"{store.path}: labels='target' needs the target's top-k predictions, "
                    "but this store has none (extract with topk=K)"
                )
            yield sample
            taken += 1
            if max_samples is not None and taken >= max_samples:
                return


def eval_anchors(loss_mask: torch.Tensor, block_size: int, stride: int = 1, max_blocks: int | None = None) -> torch.Tensor:
    """Anchors throughout the response: every candidate (`anchor_candidates`), or
    every `stride`-th; with `max_blocks`, that many spread evenly over them."""
    if stride < 1:
        raise ValueError(f"anchor stride must be >= 1, got {stride}")
    anchors = anchor_candidates(loss_mask, block_size)[::stride]
    if max_blocks is not None and anchors.numel() > max_blocks:
        pick = torch.linspace(0, anchors.numel() - 1, max_blocks).round().long().unique()
        anchors = anchors[pick]
    return anchors


def slot_topk(hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int, chunk_rows: int = 2048):
    """Top-k log-probs (log_softmax over the full vocabulary, fp32) and ids of
    drafter outputs `hidden` [..., H], a chunk of rows at a time so the full
    logits never exist at once. Returns ([..., k] float32, [..., k] int64)."""
    shape = hidden.shape[:-1]
    rows = hidden.reshape(-1, hidden.shape[-1])
    k = min(k, lm_head_weight.shape[0])
    values = torch.empty(rows.shape[0], k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.long, device=rows.device)
    for start in range(0, rows.shape[0], chunk_rows):
        logits = F.linear(rows[start : start + chunk_rows].to(lm_head_weight.dtype), lm_head_weight).float()
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        values[start : start + chunk_rows] = top.values
        ids[start : start + chunk_rows] = top.indices
    return values.view(*shape, k), ids.view(*shape, k)


class _Accumulator:
    def __init__(self, block_size: int, budgets: Sequence[int]):
        self.block_size = block_size
        self.budgets = list(budgets)
        self.chain_means: list[float] = []
        self.ddtree_means: dict[int, list[float]] = {b: [] for b in self.budgets}
        self.blocks = 0
        self.chain_sum = 0
        self.histogram = torch.zeros(block_size + 1, dtype=torch.long)
        self.valid = 0
        self.top = {1: 0, 4: 0, 8: 0}
        self.pos_hits = torch.zeros(block_size - 1, dtype=torch.long)
        self.pos_valid = torch.zeros(block_size - 1, dtype=torch.long)

    def add_sample(self, chain: torch.Tensor, ddtree: dict[int, torch.Tensor], counts: list[dict]) -> None:
        if chain.numel() == 0:
            return
        self.chain_means.append(float(chain.double().mean()))
        for b in self.budgets:
            self.ddtree_means[b].append(float(ddtree[b].double().mean()))
        self.blocks += chain.numel()
        self.chain_sum += int(chain.sum())
        self.histogram += torch.bincount(chain, minlength=self.block_size + 1)[: self.block_size + 1]
        for c in counts:
            self.valid += c["valid"]
            for k in self.top:
                self.top[k] += c[f"top{k}"]
            self.pos_hits += c["per_position_top1"].cpu()
            self.pos_valid += c["per_position_valid"].cpu()

    def result(self) -> dict:
        def mean(values):
            return sum(values) / len(values) if values else float("nan")

        def ratio(a, b):
            return a / b if b else float("nan")

        return {
            "tau": mean(self.chain_means),
            "ddtree": {b: mean(self.ddtree_means[b]) for b in self.budgets},
            "per_position_acc": [ratio(int(h), int(v)) for h, v in zip(self.pos_hits, self.pos_valid)],
            "top1_acc": ratio(self.top[1], self.valid),
            "top4_acc": ratio(self.top[4], self.valid),
            "top8_acc": ratio(self.top[8], self.valid),
            "tau_pooled": ratio(self.chain_sum, self.blocks),
            "acceptance_histogram": [ratio(int(c), self.blocks) for c in self.histogram[1:]],
            "samples": len(self.chain_means),
            "blocks": self.blocks,
            "scored_slots": self.valid,
            "block_size": self.block_size,
        }


def _context_features(sample, config, device) -> torch.Tensor:
    """[T, n_ctx*H] drafter input of a store_schema `Sample` (`hidden` by layer id)
    or a train.loader `TrainSample` (`context_features()`, already in fc order)."""
    if hasattr(sample, "context_features"):
        features = sample.context_features(device)
        expected = config.num_context_layers * config.hidden_size
        if features.shape[-1] != expected:
            raise ValueError(f"sample {sample.sample_id}: context features of width {features.shape[-1]}, drafter needs {expected}")
        return features
    missing = [layer for layer in config.context_layer_ids if layer not in sample.hidden]
    if missing:
        raise KeyError(f"sample {sample.sample_id} lacks context layers {missing} the drafter reads")
    return torch.cat([sample.hidden[layer] for layer in config.context_layer_ids], dim=-1).to(device)


@torch.no_grad()
def evaluate_samples(drafter, head, samples: Iterable, config: EvalConfig, attention: str = "auto") -> dict:
    """Acceptance metrics of `drafter` over `samples`: store_schema `Sample`s with
    `hidden` holding the drafter's context layers, or train.loader `TrainSample`s
    (e.g. `ShardLoader.heldout_samples(limit)`). See `evaluate` for the result.

    drafter: train.model.DFlashDrafter (put in eval mode for the call, then
    restored); head: train.target_head.TargetHead. Runs on the drafter's device.
    config: ddtree_budgets, labels, anchor_stride, max_blocks_per_sample,
    batch_blocks (`samples` is the caller's business). attention: the run's
    `model.attention`."""
    config.validate()
    labels, anchor_stride, batch_blocks = config.labels, config.anchor_stride, config.batch_blocks
    max_blocks_per_sample = config.max_blocks_per_sample
    budgets = sorted({int(b) for b in config.ddtree_budgets})
    drafter_config = drafter.config
    block_size = drafter_config.block_size
    device = drafter.fc.weight.device
    k = max([8, *budgets])
    acc = _Accumulator(block_size, budgets)
    was_training = drafter.training
    drafter.eval()
    try:
        for sample in samples:
            input_ids = sample.input_ids.long().to(device)
            loss_mask = sample.loss_mask.to(device)
            anchors = eval_anchors(sample.loss_mask, block_size, anchor_stride, max_blocks_per_sample).to(device)
            if anchors.numel() == 0:
                continue
            target_next_ids = None
            if labels == "target":
                if sample.topk_ids is None:
                    raise ValueError(f"sample {sample.sample_id}: labels='target' needs stored top-k ids")
                target_next_ids = sample.topk_ids[:, 0].long().to(device)
            # Weights are unused here; gamma=1 only satisfies block_targets for any B.
            targets = block_targets(
                input_ids, loss_mask, anchors, block_size, gamma=1.0, labels=labels, target_next_ids=target_next_ids
            )
            features = _context_features(sample, drafter_config, device)

            chain_parts, tree_parts, counts = [], {b: [] for b in budgets}, []
            for start in range(0, anchors.numel(), batch_blocks):
                batch = slice(start, start + batch_blocks)
                reference = targets.labels[batch, 1:]
                valid = targets.valid[batch, 1:]
                keep = scored_blocks(valid)
                if not keep.any():
                    continue
                hidden = drafter(features, input_ids, anchors[batch][keep], head.embed_tokens, attention=attention)
                logprobs, ids = slot_topk(hidden[:, 1:], head.lm_head.weight, k)
                reference, valid = reference[keep], valid[keep]
                chain_parts.append(chain_acceptance(ids[..., 0], reference, valid).cpu())
                trees = ddtree_acceptance(logprobs.cpu(), ids.cpu(), reference.cpu(), valid.cpu(), budgets)
                for b in budgets:
                    tree_parts[b].append(trees[b])
                counts.append(accuracy_counts(topk_hits(ids, reference, (1, 4, 8)), valid))
            if chain_parts:
                acc.add_sample(torch.cat(chain_parts), {b: torch.cat(tree_parts[b]) for b in budgets}, counts)
    finally:
        drafter.train(was_training)
    result = acc.result()
    result.update(labels=labels, anchor_stride=anchor_stride, max_blocks_per_sample=max_blocks_per_sample)
    return result


def evaluate(
    drafter,
    head,
    store,
    config: EvalConfig,
    *,
    split: str = "heldout",
    heldout_fraction: float | None = None,
    attention: str = "auto",
) -> dict:
    """Evaluate `drafter` on the `split` samples of `store` (a store_schema.Store
    or its path), at most `config.samples` of them (None: all).

    heldout_fraction: the held-out share of the run the drafter was trained by
    (needed unless split="all"): "heldout" is exactly the samples that run never
    trained on, "train" the others.

    Returns a dict:
      tau: mean acceptance length (accepted + 1 bonus, 1..B) under greedy chain
          verification, per sample then over samples;
      ddtree: {budget: the same under DDTree verification at that node budget};
      per_position_acc: [B-1] top-1 accuracy of slots 1..B-1;
      top1_acc / top4_acc / top8_acc: pooled over scored slots;
      tau_pooled: chain acceptance averaged over all blocks at once;
      acceptance_histogram: [B] share of blocks with length 1..B;
      samples / blocks / scored_slots: what was evaluated;
      block_size, labels, split, heldout_fraction, anchor_stride, max_blocks_per_sample.
    Samples with no scoreable block are not counted."""
    from store_schema import Store

    store = store if isinstance(store, Store) else Store(store)
    check_compatible(drafter, head, store)
    if config.labels == "target" and not store.fingerprint.target_topk:
        raise ValueError(
            f"{store.path}: labels='target' needs the target's top-k predictions, "
            "but this store has none (extract with topk=K)"
        )
    samples = store_samples(
        store,
        drafter.config.context_layer_ids,
        split=split,
        heldout_fraction=heldout_fraction,
        max_samples=config.samples,
        need_topk=config.labels == "target",
    )
    result = evaluate_samples(drafter, head, samples, config, attention=attention)
    result.update(split=split, heldout_fraction=None if split == "all" else heldout_fraction)
    return result


def check_compatible(drafter, head, store) -> None:
    """Refuse a store that was not extracted from the drafter's target: hidden
    size, layer count, vocabulary and the context layers must all agree."""
    config = drafter.config
    store.fingerprint.check(
        hidden_size=config.hidden_size, num_target_layers=config.num_target_layers, vocab_size=head.vocab_size
    )
    store.require_layers(config.context_layer_ids)
