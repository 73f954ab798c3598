"""Acceptance evaluation of a drafter on stored samples: decode-time tau, DDTree
acceptance, the per-position estimate and per-position / top-1/4/8 accuracy.

The drafter drafts a block at every position a decoding round could anchor at
(a response position whose next position is one too: `rollout_anchors`), up to
`max_blocks_per_sample` of them from the start of the sample's responses. Each
block is drafted exactly as in training (context features strictly before the
anchor, `[anchor, MASK x (B-1)]`), then its slots 1..B-1 are scored through the
target's frozen lm_head and compared with the reference continuation:

- labels="tokens": the stored tokens `input_ids[a + k]` (what was written);
- labels="target": the target's greedy prediction for each position, the top-1 of
  the store's recorded top-k (`topk_ids[a + k - 1, 0]`). Teacher-forced: slot k's
  reference is the target's choice given the *stored* prefix, which equals its
  greedy continuation from the anchor whenever the earlier slots agree with the
  stored tokens.

From those blocks (definitions in `train/measures.py`):

- `tau`: decode-time. Each response is decoded the way a server would, round by
  round (`acceptance.rollout`): start at its first position, draft along the path
  the drafter decodes (`drafted_path`: the selector's walk for DFlash 2), accept
  the matching prefix, move the anchor by accepted + 1. Averaged per sample, then
  over samples. This is the headline, comparable with what `speculate` and a
  server measure when the reference is what the target generates. `tau_unary` is
  the same rollout along each slot's own argmax (equal to `tau` for DFlash).
- `ddtree`: the same rollout with DDTree verification, per node budget (each
  budget walks its own anchors; trees are grown only where a walk goes).
- `tau_per_position`: the older estimator, chain acceptance averaged over blocks
  anchored at every training-anchor position (`anchor_candidates`, every
  `anchor_stride`-th) of the same stretch; higher than `tau` whenever the drafter
  has hard stretches, because rounds pile up there.
- accuracies: pooled over the scored slots of those per-position blocks.

What to evaluate is the run's `eval` section (`train.evaluation.config.EvalConfig`); which
samples are held out is `train.data.heldout` at the run's own fraction. The training
loop evaluates through `train.fitting.periodic_eval`; `python -m train eval` calls
`evaluate`; `evaluate_sample_ids` scores exactly the samples (e.g. the prompts
`python -m train speculate` decoded) a caller names.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch

from store_schema import StoreReader
from store_schema.stores import open_store
from store_schema.tools.local_copy import local_copy_holding
from train.compatibility import check_drafter_against_store, check_topk
from train.data.heldout import locate_samples, read_located, read_samples, split_locations
from train.evaluation.config import EvalConfig
from train.evaluation.stands_for import tau_stands_for
from train.families.family import DraftedBlocks
from train.families.kinds import family_of
from train.measures import accuracy_counts, topk_hits


def rollout_anchors(loss_mask: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """Positions a decoding round can anchor at: response positions whose next
    position is part of the response too; the first `limit` of them (None: all)."""
    mask = loss_mask.bool()
    anchors = (mask[:-1] & mask[1:]).nonzero().flatten()
    return anchors if limit is None else anchors[:limit]


def per_position_rows(blocks: DraftedBlocks, trainable: torch.Tensor, stride: int) -> torch.Tensor:
    """Rows of `blocks` the per-position estimate averages over: every `stride`-th
    position a training step may draft from (`trainable`: the family's
    `trainable_positions`, DFlash's anchors) of the drafted stretch whose slot 1 is
    part of the response."""
    candidates = trainable[trainable <= blocks.positions[-1]][::stride].contiguous()
    rows = torch.searchsorted(blocks.positions, candidates)
    return rows[blocks.positions[rows.clamp(max=len(blocks.positions) - 1)] == candidates]


class _Accumulator:
    """Per-sample rollouts and pooled per-position counts, turned into the result."""

    def __init__(self, positions: int, budgets: Sequence[int]):
        self.block_size = positions + 1  # the most tokens a round commits
        self.budgets = list(budgets)
        self.per_sample: list[dict] = []
        self.ddtree_means: dict[int, list[float]] = {b: [] for b in self.budgets}
        self.per_position_means: list[float] = []
        self.rounds: list[int] = []
        self.blocks = 0
        self.valid = 0
        self.top = {1: 0, 4: 0, 8: 0}
        self.pos_hits = torch.zeros(positions, dtype=torch.long)
        self.pos_valid = torch.zeros(positions, dtype=torch.long)

    def add_sample(self, sample_id: str, blocks: DraftedBlocks, rows: torch.Tensor) -> None:
        rounds = blocks.chain_rounds()
        if not rounds:
            return
        unary = blocks.chain_rounds(unary=True)
        entry = {
            "sample_id": sample_id,
            "tau": sum(rounds) / len(rounds),
            "rounds": len(rounds),
            "tokens": sum(rounds),
            "tau_unary": sum(unary) / len(unary),
        }
        self.rounds += rounds
        for budget, tree_rounds in blocks.ddtree_rounds(self.budgets).items():
            self.ddtree_means[budget].append(sum(tree_rounds) / len(tree_rounds))
        if rows.numel():
            lengths = blocks.accepted[rows] + 1
            tau_per_position = float(lengths.double().mean())
            entry["tau_per_position"] = tau_per_position
            self.per_position_means.append(tau_per_position)
            self.blocks += rows.numel()
            counts = accuracy_counts(topk_hits(blocks.ids[rows], blocks.reference[rows], (1, 4, 8)), blocks.valid[rows])
            self.valid += counts["valid"]
            for k in self.top:
                self.top[k] += counts[f"top{k}"]
            self.pos_hits += counts["per_position_top1"]
            self.pos_valid += counts["per_position_valid"]
        self.per_sample.append(entry)

    def result(self) -> dict:
        def mean(values):
            return sum(values) / len(values) if values else float("nan")

        def ratio(a, b):
            return a / b if b else float("nan")

        histogram = torch.bincount(torch.tensor(self.rounds, dtype=torch.long), minlength=self.block_size + 1)
        return {
            "tau": mean([s["tau"] for s in self.per_sample]),
            "tau_unary": mean([s["tau_unary"] for s in self.per_sample]),
            "ddtree": {b: mean(self.ddtree_means[b]) for b in self.budgets},
            "tau_per_position": mean(self.per_position_means),
            "per_position_acc": [ratio(int(h), int(v)) for h, v in zip(self.pos_hits, self.pos_valid)],
            "top1_acc": ratio(self.top[1], self.valid),
            "top4_acc": ratio(self.top[4], self.valid),
            "top8_acc": ratio(self.top[8], self.valid),
            "tau_pooled": ratio(sum(self.rounds), len(self.rounds)),
            "acceptance_histogram": [ratio(int(c), len(self.rounds)) for c in histogram[1 : self.block_size + 1]],
            "samples": len(self.per_sample),
            "rounds": len(self.rounds),
            "blocks": self.blocks,
            "scored_slots": self.valid,
            "block_size": self.block_size,
            "per_sample": self.per_sample,
        }


def _context_features(sample, config, device) -> torch.Tensor:
    """[T, n_ctx*H] drafter input of a store_schema `Sample` (`hidden` by layer id)
    or a train.data.loader `TrainSample` (`context_features()`, already in fc order)."""
    if hasattr(sample, "context_features"):
        features = sample.context_features(device)
        expected = config.num_context_layers * config.hidden_size
        if features.shape[-1] != expected:
            raise ValueError(
                f"sample {sample.sample_id}: context features of width {features.shape[-1]}, drafter needs {expected}"
            )
        return features
    missing = [layer for layer in config.context_layer_ids if layer not in sample.hidden]
    if missing:
        raise KeyError(f"sample {sample.sample_id} lacks context layers {missing} the drafter reads")
    return torch.cat([sample.hidden[layer] for layer in config.context_layer_ids], dim=-1).to(device)


def score_sample(acc: _Accumulator, family, drafter, head, sample, config: EvalConfig, k: int, attention: str):
    """Draft one sample's blocks at its round starts and add them to `acc`."""
    positions = rollout_anchors(sample.loss_mask, config.max_blocks_per_sample)
    if positions.numel() == 0:
        return
    features = _context_features(sample, drafter.config, next(drafter.parameters()).device)
    blocks = family.draft_blocks(drafter, head, sample, features, positions, config, k, attention)
    trainable = family.trainable_positions(sample.loss_mask.cpu(), drafter.config)
    acc.add_sample(sample.sample_id, blocks, per_position_rows(blocks, trainable, config.anchor_stride))


@torch.no_grad()
def evaluate_samples(
    drafter, head, samples: Iterable, config: EvalConfig, attention: str = "auto", progress=None
) -> dict:
    """Acceptance metrics of `drafter` over `samples`: store_schema `Sample`s with
    `hidden` holding the drafter's context layers, or train.data.loader `TrainSample`s
    (e.g. `ShardLoader.heldout_samples(limit)`).

    drafter: of any family (`train.families.kinds`; put in eval mode for the call,
    then restored); head: train.target_head.TargetHead. Runs on the drafter's device.
    config: ddtree_budgets, labels, anchor_stride, max_blocks_per_sample,
    batch_blocks (`samples` is the caller's business). attention: the run's
    `model.attention`. progress: a `store_schema.runtime.progress.Progress`
    advanced by each sample (closed at the end), or None.

    Returns a dict:
      tau: decode-time acceptance length (accepted + 1 bonus, 1..B) under greedy
          chain verification, rolled out along each response, per sample then
          over samples, along the path the drafter decodes (`drafted_path`: each
          slot's argmax for DFlash, the candidate selector's walk from the anchor
          for DFlash 2): what `speculate` and the engines measure;
      tau_unary: the same rollout along the unary argmax chain (each slot's own
          top-1); equal to `tau` for DFlash;
      path: the path `tau` follows ("argmax chain", "selector walk");
      ddtree: {budget: the same under DDTree verification at that node budget};
      tau_per_position: chain acceptance along the drafted path over blocks at
          every anchor position (the per-position estimate), per sample then
          over samples;
      per_position_acc: [B-1] top-1 accuracy of slots 1..B-1;
      top1_acc / top4_acc / top8_acc: pooled over scored slots;
      tau_pooled: the rollout's rounds pooled over all samples at once;
      acceptance_histogram: [B] share of rollout rounds of length 1..B;
      samples / rounds / blocks / scored_slots: what was evaluated;
      per_sample: [{sample_id, tau, tau_unary, rounds, tokens, tau_per_position}];
      block_size, labels, anchor_stride, max_blocks_per_sample (`evaluate` adds split, heldout_fraction)."""
    config.validate()
    budgets = sorted({int(b) for b in config.ddtree_budgets})
    family = family_of(drafter)
    k = max([8, *budgets])
    acc = _Accumulator(family.drafted_positions(drafter.config), budgets)
    was_training = drafter.training
    drafter.eval()
    try:
        for sample in samples:
            score_sample(acc, family, drafter, head, sample, config, k, attention)
            if progress is not None:
                progress.update(1)
    finally:
        drafter.train(was_training)
        if progress is not None:
            progress.close()
    return dict(
        acc.result(),
        path=family.decode_path(drafter.config),
        labels=config.labels,
        anchor_stride=config.anchor_stride,
        max_blocks_per_sample=config.max_blocks_per_sample,
    )


def evaluate(
    drafter,
    head,
    store,
    config: EvalConfig,
    *,
    split: str = "heldout",
    heldout_fraction: float | None = None,
    attention: str = "auto",
    progress=None,
    cache_dir=None,
) -> dict:
    """Evaluate `drafter` on the `split` samples of `store` (a store_schema.Store
    or its path), at most `config.samples` of them (None: all).

    heldout_fraction: the held-out share of the run the drafter was trained by
    (needed unless split="all"): "heldout" is exactly the samples that run never
    trained on, "train" the others.

    Returns `evaluate_samples`' figures and the split's (split_samples: samples in the
    split; max_samples: the cap, config.samples).
    Samples with no scoreable block are not counted. progress: a callable
    (samples to evaluate) -> Progress, shown while evaluating, or None.
    cache_dir: read the samples' shards whole through this local copy of the store
    (`local_copy_holding`), not a request per row; `cached_shards_fetched` counts."""
    store = store if isinstance(store, StoreReader) else open_store(store)
    _check_store(drafter, head, store, config)
    locations = split_locations(store, split, heldout_fraction)
    fetched = None
    if cache_dir is not None:
        store, fetched = local_copy_holding(store, cache_dir, [loc.shard for loc in locations[: config.samples]])
    samples = read_samples(
        store, locations[: config.samples], drafter.config.context_layer_ids, need_topk=config.labels == "target"
    )
    bar = progress(len(locations[: config.samples])) if progress else None
    result = evaluate_samples(drafter, head, samples, config, attention=attention, progress=bar)
    result.update(
        split=split,
        heldout_fraction=None if split == "all" else heldout_fraction,
        split_samples=len(locations),
        max_samples=config.samples,
        stands_for=tau_stands_for(store.fingerprint, config.labels),
    )
    if fetched is not None:
        result["cached_shards_fetched"] = fetched
    return result


def evaluate_sample_ids(
    drafter,
    head,
    store,
    sample_ids: Sequence[str],
    config: EvalConfig,
    max_new_tokens: int | None = None,
    attention: str = "auto",
) -> dict:
    """`evaluate` on exactly `sample_ids` of `store` (in that order), each cut to
    its first response and that response's first `max_new_tokens` tokens: the
    stretch `speculate` decodes from the same prompt (everything before the first
    response token) with `--max-new-tokens`, so the two taus compare on the same
    text. `per_sample` holds each sample's rollout tau."""
    store = store if isinstance(store, StoreReader) else open_store(store)
    _check_store(drafter, head, store, config)
    wanted = set(sample_ids)
    where = {loc.sample_id: loc for loc in locate_samples(store, store.committed_shards(), wanted.__contains__)}
    missing = [i for i in sample_ids if i not in where]
    if missing:
        raise KeyError(
            f"{store.path}: no committed sample {missing[0]!r} ({len(missing)} of the ids are not in the store)"
        )
    layers = drafter.config.context_layer_ids
    samples = (first_response(read_located(store, where[i], layers), max_new_tokens) for i in sample_ids)
    return evaluate_samples(drafter, head, samples, dataclasses.replace(config, max_blocks_per_sample=None), attention)


def first_response(sample, max_tokens: int | None = None):
    """The sample with its loss mask cut to its first response (the first run of
    loss_mask == 1) and, with `max_tokens`, to that response's first tokens."""
    mask = sample.loss_mask.clone()
    on = mask.bool().nonzero().flatten()
    if on.numel():
        start = int(on[0])
        off = (~mask[start:].bool()).nonzero().flatten()
        stop = start + int(off[0]) if off.numel() else mask.numel()
        if max_tokens is not None:
            stop = min(stop, start + max_tokens)
        mask[stop:] = 0
    return dataclasses.replace(sample, loss_mask=mask)


def _check_store(drafter, head, store, config: EvalConfig) -> None:
    check_drafter_against_store(drafter.config, head.vocab_size, store)
    check_topk(store, ["eval.labels=target"] if config.labels == "target" else [])
