"""Evaluators the training loop runs every `eval.every` steps (`Trainer.evaluators`).

Each is a callable `(trainer, step) -> dict` whose dict is merged into that step's
log line; each takes the run's `eval` section and reads up to `eval.samples`
held-out sequences from `trainer.loader.heldout_samples`, so it sees exactly the
samples the run never trains on. Evaluation never moves the training RNG.

- `HeldoutEval`: the training objective on held-out data (`heldout_loss`,
  `heldout_acc`, `heldout_tau_per_position` over randomly drawn training
  anchors, pooled over blocks), without noise.
- `AcceptanceEval`: `train.evaluation.evaluate.evaluate_samples` as the flat `eval_*`
  fields of `log_fields`: `eval_tau` (decode-time rollout, the headline),
  `eval_ddtree_<budget>` (rollout with DDTree verification),
  `eval_tau_per_position` (the per-position estimate over the same stretch).
"""

from __future__ import annotations

import math

import torch

from train.evaluation.config import EvalConfig
from train.evaluation.evaluate import evaluate_samples
from train.fitting.metrics import MetricSums

HELDOUT_SEED_OFFSET = 1_000_003  # the held-out pass's generator: the run's seed + this


class HeldoutEval:
    """Held-out loss / accuracy / tau with its own fixed generator."""

    def __init__(self, config: EvalConfig):
        self.config = config

    def __call__(self, trainer, step: int) -> dict:
        sums = MetricSums(trainer.family.drafted_positions(trainer.drafter.config), trainer.device)
        generator = torch.Generator().manual_seed(trainer.config.train.seed + HELDOUT_SEED_OFFSET)
        was_training = trainer.drafter.training
        trainer.drafter.eval()
        with torch.no_grad():
            for sample in trainer.loader.heldout_samples(self.config.samples):
                sums.add(trainer.run_sequence(sample, generator, noise=0.0), sample.num_tokens)
        trainer.drafter.train(was_training)
        if sums.sequences == 0:
            return {"heldout_samples": 0}
        return {**sums.means("heldout_"), "heldout_samples": sums.sequences}


class AcceptanceEval:
    """Acceptance of the current drafter on the held-out sequences, as flat log
    fields with `prefix` (eval_tau, eval_tau_per_position, eval_ddtree_<budget>,
    ...). `attention` is the run's `model.attention`."""

    def __init__(self, config: EvalConfig, attention: str = "auto", prefix: str = "eval_"):
        self.config = config
        self.attention = attention
        self.prefix = prefix

    def __call__(self, trainer, step: int) -> dict:
        samples = trainer.loader.heldout_samples(self.config.samples)
        with trainer.autocast():  # training's dtype: the compiled flex graphs are shared, not recompiled in fp32
            result = evaluate_samples(trainer.drafter, trainer.head, samples, self.config, attention=self.attention)
        return log_fields(result, self.prefix)


def log_fields(result: dict, prefix: str = "eval_") -> dict:
    """Flat train_log.jsonl fields of an evaluation result: `{prefix}tau` (rollout),
    `{prefix}tau_per_position`, `{prefix}ddtree_{budget}` (rollout),
    `{prefix}top1_acc` / top4 / top8, `{prefix}per_position_acc` (list),
    `{prefix}samples`, `{prefix}rounds`, and, where the drafter decodes another
    path than the argmax chain (DFlash 2), `{prefix}tau_unary`. nan becomes None (JSON)."""

    def clean(value):
        return None if isinstance(value, float) and math.isnan(value) else value

    fields = {
        f"{prefix}tau": clean(result["tau"]),
        f"{prefix}tau_per_position": clean(result["tau_per_position"]),
        f"{prefix}top1_acc": clean(result["top1_acc"]),
        f"{prefix}top4_acc": clean(result["top4_acc"]),
        f"{prefix}top8_acc": clean(result["top8_acc"]),
        f"{prefix}per_position_acc": [clean(v) for v in result["per_position_acc"]],
        f"{prefix}samples": result["samples"],
        f"{prefix}rounds": result["rounds"],
    }
    if result.get("path", "argmax chain") != "argmax chain":  # DFlash 2: `tau` walks the selector
        fields[f"{prefix}tau_unary"] = clean(result["tau_unary"])
    for budget, value in result["ddtree"].items():
        fields[f"{prefix}ddtree_{budget}"] = clean(value)
    return fields
