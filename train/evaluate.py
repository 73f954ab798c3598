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

The training loop can call `evaluate` (or `evaluate_samples` on samples it already
holds) every N steps and log `log_fields(result)` into train_log.jsonl;
`AcceptanceEval` packages that as a `Trainer.evaluators` entry. Its keys carry
the prefix "eval_" (eval_tau, eval_ddtree_8, ...): the trainer's own held-out
pass logs `heldout_tau` over its randomly drawn training anchors, pooled over
blocks, which is a different number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
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
from train.loader import is_heldout
from train.loss import block_targets

DEFAULT_BUDGETS = (8, 32, 128)
SPLITS = ("heldout", "train", "all")
DEFAULT_HELDOUT_FRACTION = 0.01


def heldout(sample_id: str, fraction: float = DEFAULT_HELDOUT_FRACTION) -> bool:
    """The held-out split: the loader's rule, so trainer and eval always agree."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1], got {fraction}")
    return is_heldout(sample_id, fraction)


def in_split(sample_id: str, split: str, fraction: float) -> bool:
    if split == "all":
        return True
    if split == "heldout":
        return heldout(sample_id, fraction)
    if split == "train":
        return not heldout(sample_id, fraction)
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def store_samples(
    store,
    layers: Sequence[int],
    split: str = "heldout",
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    max_samples: int | None = None,
    need_topk: bool = False,
) -> Iterator:
    """Samples of `split` in store order (shards sorted, samples in shard order),
    reading whole shards with only `layers`. Stops after `max_samples`."""
    from store_schema import Store

    if not isinstance(store, Store):
        store = Store(store)
    layers = store.require_layers(list(layers))
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
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
def evaluate_samples(
    drafter,
    head,
    samples: Iterable,
    ddtree_budgets: Sequence[int] = DEFAULT_BUDGETS,
    labels: str = "tokens",
    anchor_stride: int = 1,
    max_blocks_per_sample: int | None = None,
    batch_blocks: int = 256,
    chunk_rows: int = 2048,
    attention: str = "auto",
) -> dict:
    """Acceptance metrics of `drafter` over `samples`: store_schema `Sample`s with
    `hidden` holding the drafter's context layers, or train.loader `TrainSample`s
    (e.g. `ShardLoader.heldout_samples(limit)`). See `evaluate` for the result.

    drafter: train.model.DFlashDrafter (put in eval mode for the call, then
    restored); head: train.target_head.TargetHead. Runs on the drafter's device."""
    if labels not in ("tokens", "target"):
        raise ValueError(f'labels must be "tokens" or "target", got {labels!r}')
    budgets = sorted({int(b) for b in ddtree_budgets})
    if any(b < 1 for b in budgets):
        raise ValueError(f"DDTree budgets must be >= 1, got {list(ddtree_budgets)}")
    config = drafter.config
    block_size = config.block_size
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
            features = _context_features(sample, config, device)

            chain_parts, tree_parts, counts = [], {b: [] for b in budgets}, []
            for start in range(0, anchors.numel(), batch_blocks):
                batch = slice(start, start + batch_blocks)
                reference = targets.labels[batch, 1:]
                valid = targets.valid[batch, 1:]
                keep = scored_blocks(valid)
                if not keep.any():
                    continue
                hidden = drafter(features, input_ids, anchors[batch][keep], head.embed_tokens, attention=attention)
                logprobs, ids = slot_topk(hidden[:, 1:], head.lm_head.weight, k, chunk_rows)
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
    split: str = "heldout",
    ddtree_budgets: Sequence[int] = DEFAULT_BUDGETS,
    labels: str = "tokens",
    max_samples: int | None = None,
    anchor_stride: int = 1,
    max_blocks_per_sample: int | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    batch_blocks: int = 256,
    chunk_rows: int = 2048,
    attention: str = "auto",
) -> dict:
    """Evaluate `drafter` on the `split` samples of `store` (a store_schema.Store
    or its path).

    Returns a dict:
      tau: mean acceptance length (accepted + 1 bonus, 1..B) under greedy chain
          verification, per sample then over samples;
      ddtree: {budget: the same under DDTree verification at that node budget};
      per_position_acc: [B-1] top-1 accuracy of slots 1..B-1;
      top1_acc / top4_acc / top8_acc: pooled over scored slots;
      tau_pooled: chain acceptance averaged over all blocks at once;
      acceptance_histogram: [B] share of blocks with length 1..B;
      samples / blocks / scored_slots: what was evaluated;
      block_size, labels, split, anchor_stride, max_blocks_per_sample.
    Samples with no scoreable block are not counted."""
    from store_schema import Store

    store = store if isinstance(store, Store) else Store(store)
    check_compatible(drafter, head, store)
    if labels == "target" and not store.fingerprint.target_topk:
        raise ValueError(
            f"{store.path}: labels='target' needs the target's top-k predictions, "
            "but this store has none (extract with topk=K)"
        )
    samples = store_samples(
        store,
        drafter.config.context_layer_ids,
        split=split,
        heldout_fraction=heldout_fraction,
        max_samples=max_samples,
        need_topk=labels == "target",
    )
    result = evaluate_samples(
        drafter,
        head,
        samples,
        ddtree_budgets=ddtree_budgets,
        labels=labels,
        anchor_stride=anchor_stride,
        max_blocks_per_sample=max_blocks_per_sample,
        batch_blocks=batch_blocks,
        chunk_rows=chunk_rows,
        attention=attention,
    )
    result["split"] = split
    return result


def check_compatible(drafter, head, store) -> None:
    """Refuse a store that was not extracted from the drafter's target: hidden
    size, layer count, vocabulary and the context layers must all agree."""
    config = drafter.config
    store.fingerprint.check(
        hidden_size=config.hidden_size, num_target_layers=config.num_target_layers, vocab_size=head.vocab_size
    )
    store.require_layers(config.context_layer_ids)


class AcceptanceEval:
    """An evaluator for the training loop (`Trainer.evaluators`, called as
    `evaluator(trainer, step) -> dict` every `eval_every` steps): acceptance of
    the current drafter on up to `samples` held-out sequences from
    `trainer.loader.heldout_samples(samples)`, as flat log fields
    (`log_fields`, prefix "eval_": eval_tau, eval_ddtree_<budget>, ...).

    `max_blocks_per_sample` caps the cost: that many anchors spread evenly over
    each response (None: every anchor position)."""

    def __init__(
        self,
        samples: int = 32,
        ddtree_budgets: Sequence[int] = DEFAULT_BUDGETS,
        labels: str = "tokens",
        anchor_stride: int = 1,
        max_blocks_per_sample: int | None = 256,
        prefix: str = "eval_",
    ):
        self.samples = samples
        self.ddtree_budgets = tuple(ddtree_budgets)
        self.labels = labels
        self.anchor_stride = anchor_stride
        self.max_blocks_per_sample = max_blocks_per_sample
        self.prefix = prefix

    def __call__(self, trainer, step: int) -> dict:
        result = evaluate_samples(
            trainer.drafter,
            trainer.head,
            trainer.loader.heldout_samples(self.samples),
            ddtree_budgets=self.ddtree_budgets,
            labels=self.labels,
            anchor_stride=self.anchor_stride,
            max_blocks_per_sample=self.max_blocks_per_sample,
        )
        return log_fields(result, self.prefix)


def log_fields(result: dict, prefix: str = "eval_") -> dict:
    """Flat train_log.jsonl fields of an evaluation result: `{prefix}tau`,
    `{prefix}ddtree_{budget}`, `{prefix}top1_acc` / top4 / top8,
    `{prefix}per_position_acc` (list), `{prefix}samples`. nan becomes None (JSON)."""

    def clean(value):
        return None if isinstance(value, float) and math.isnan(value) else value

    fields = {
        f"{prefix}tau": clean(result["tau"]),
        f"{prefix}top1_acc": clean(result["top1_acc"]),
        f"{prefix}top4_acc": clean(result["top4_acc"]),
        f"{prefix}top8_acc": clean(result["top8_acc"]),
        f"{prefix}per_position_acc": [clean(v) for v in result["per_position_acc"]],
        f"{prefix}samples": result["samples"],
    }
    for budget, value in result["ddtree"].items():
        fields[f"{prefix}ddtree_{budget}"] = clean(value)
    return fields


def to_json(result: dict) -> str:
    """One JSON object on one line; ddtree budgets become string keys, nan becomes null."""

    def clean(value):
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(result))  # one line: `tail -1 | jq` works


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def render_table(result: dict) -> str:
    """A readable summary: headline acceptance, accuracies, per-position accuracy."""
    block = result.get("block_size", len(result["per_position_acc"]) + 1)
    lines = [
        f"split {result.get('split', '?')}, labels {result.get('labels', '?')}: "
        f"{result['samples']} samples, {result['blocks']} blocks of {block} "
        f"(anchor stride {result.get('anchor_stride', 1)})",
        "",
        f"{'metric':<28}{'value':>10}",
        f"{'-' * 38}",
        f"{'tau (greedy chain)':<28}{_fmt(result['tau']):>10}",
    ]
    for budget, value in sorted(result["ddtree"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{f'DDTree acceptance @ {budget}':<28}{_fmt(value):>10}")
    lines += [
        f"{'top-1 accuracy':<28}{_fmt(result['top1_acc']):>10}",
        f"{'top-4 accuracy':<28}{_fmt(result['top4_acc']):>10}",
        f"{'top-8 accuracy':<28}{_fmt(result['top8_acc']):>10}",
        "",
        "per-position top-1 accuracy (slot: acc)",
    ]
    per_position = result["per_position_acc"]
    for row in range(0, len(per_position), 5):
        cells = [f"{row + i + 1:>2}: {_fmt(v)}" for i, v in enumerate(per_position[row : row + 5])]
        lines.append("  " + "   ".join(cells))
    histogram = result.get("acceptance_histogram")
    if histogram:
        lines += ["", "chain acceptance length histogram (length: share)"]
        for row in range(0, len(histogram), 8):
            cells = [f"{row + i + 1:>2}: {_fmt(v, 2)}" for i, v in enumerate(histogram[row : row + 8])]
            lines.append("  " + "   ".join(cells))
    return "\n".join(lines)


def resolve_drafter_dir(path: str | Path) -> Path:
    """An exported drafter directory (config.json with dflash_config +
    model.safetensors), given either that directory or a run directory holding
    exports below it (the most recently written one is taken)."""
    path = Path(path)

    def is_export(p: Path) -> bool:
        config = p / "config.json"
        if not (config.is_file() and (p / "model.safetensors").is_file()):
            return False
        try:
            return "dflash_config" in json.loads(config.read_text())
        except ValueError:
            return False

    if is_export(path):
        return path
    found = [p.parent for p in path.glob("**/config.json") if is_export(p.parent)]
    if not found:
        raise FileNotFoundError(
            f"{path}: no exported drafter (config.json with dflash_config + model.safetensors) here or below; "
            "export a checkpoint first (python -m train export)"
        )
    return max(found, key=lambda p: (p / "model.safetensors").stat().st_mtime)
