"""The run config's `eval` section: what an acceptance evaluation measures, during
training (`train.fitting.periodic_eval`) and in `python -m train eval`;
`train/config.py` composes it into the run's."""

from __future__ import annotations

from dataclasses import dataclass

from train.config_error import require

EVAL_CLI_SAMPLES = 256  # `python -m train eval` evaluates at most this many samples unless told otherwise
LABELS = ("tokens", "target")  # what drafted positions are scored against: the stored tokens, or the target's top-1


@dataclass
class EvalConfig:
    """Acceptance evaluation (train.evaluation.evaluate): during training on held-out samples
    every `every` steps, and by `python -m train eval`, whose flags set the same
    fields (that command caps samples at EVAL_CLI_SAMPLES and rolls out whole
    responses unless told otherwise)."""

    every: int = 500  # during training: evaluate every this many optimizer steps (0: never)
    samples: int | None = 32  # held-out sequences per evaluation (None: all of them)
    ddtree_budgets: tuple[int, ...] = (8, 32, 128)  # DDTree node budgets
    labels: str = "tokens"  # reference: "tokens" (the stored ones) or "target" (the store's target top-1)
    anchor_stride: int = 1  # tau_per_position and accuracies: every k-th anchor position (the rollout needs all)
    max_blocks_per_sample: int | None = 512  # rollout over the first this many response positions (None: all)
    batch_blocks: int = 256  # blocks per drafter forward

    def validate(self):
        require(self.every >= 0, "eval.every", "must be >= 0")
        require(self.samples is None or self.samples >= 1, "eval.samples", "must be >= 1 (or null: all)")
        require(
            len(self.ddtree_budgets) >= 1 and all(b >= 1 for b in self.ddtree_budgets),
            "eval.ddtree_budgets",
            "must be one or more integers >= 1",
        )
        require(self.labels in LABELS, "eval.labels", 'must be "tokens" or "target"')
        require(self.anchor_stride >= 1, "eval.anchor_stride", "must be >= 1")
        require(
            self.max_blocks_per_sample is None or self.max_blocks_per_sample >= 1,
            "eval.max_blocks_per_sample",
            "must be >= 1 (or null: all)",
        )
        require(self.batch_blocks >= 1, "eval.batch_blocks", "must be >= 1")
        return self
