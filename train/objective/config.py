"""The run config's section the objective owns: `loss` (train.objective.step,
targets and loss); `train/config.py` composes it into the run's."""

from __future__ import annotations

from dataclasses import dataclass

from train.config_error import require
from train.drafter.config import LABELS

NORMALIZE = ("step", "sequence")  # loss.normalize: over an optimizer step's weighted labels, or per sequence
POSITION_WEIGHTS = ("decay", "dpace")  # loss.position_weights: exp(-(k-1)/gamma), or D-PACE (arXiv 2605.18810)


@dataclass
class LossConfig:
    gamma: float | None = None  # slot weight exp(-(k-1)/gamma); None: 7 for B=16, 5 for B=10, 4 for B=8
    labels: str = "tokens"  # "tokens": the sequence's own tokens; "target": the store's target top-1
    kl_mix: float = 0.0  # weight of soft KL to the store's target top-k (0: hard CE, as DFlash trains)
    noise: float = 0.0  # uniform noise scale on the drafter's context features only (0: off)
    chunk_rows: int = 1024  # scored rows per loss chunk: peak ~ chunk_rows x vocab fp32 x 3
    normalize: str = (
        "step"  # "step": over all weighted labels of an optimizer step (SpecForge); "sequence": per sequence
    )
    # "dpace" (the default: ahead of "decay" for both drafters in benchmarks/drafter_bench.py):
    # D-PACE's dynamic weights, hard CE only; "decay": exp(-(k-1)/gamma)
    position_weights: str = "dpace"
    dpace_alpha: float = 0.5  # D-PACE confidence smoothing: (1 - alpha) q + alpha (the paper's and speculators' 0.5)
    selector_weight: float = 1.0  # DFlash 2: weight of the selector's K-way CE beside the main loss
    selector_warmup_steps: int = 0  # DFlash 2: linear ramp of selector_weight over the first steps (0: none)

    def validate(self):
        require(self.gamma is None or self.gamma > 0, "loss.gamma", "must be > 0")
        require(self.labels in LABELS, "loss.labels", 'must be "tokens" or "target"')
        require(0.0 <= self.kl_mix <= 1.0, "loss.kl_mix", "must be in [0, 1]")
        require(self.noise >= 0.0, "loss.noise", "must be >= 0")
        require(self.chunk_rows >= 1, "loss.chunk_rows", "must be >= 1")
        require(self.normalize in NORMALIZE, "loss.normalize", 'must be "step" or "sequence"')
        require(self.position_weights in POSITION_WEIGHTS, "loss.position_weights", 'must be "decay" or "dpace"')
        require(0.0 <= self.dpace_alpha <= 1.0, "loss.dpace_alpha", "must be in [0, 1]")
        require(
            self.position_weights != "dpace" or self.kl_mix == 0.0,
            "loss.position_weights",
            "dpace (the default) is hard CE only: with loss.kl_mix > 0 set loss.position_weights=decay",
        )
        require(self.selector_weight >= 0.0, "loss.selector_weight", "must be >= 0")
        require(self.selector_warmup_steps >= 0, "loss.selector_warmup_steps", "must be >= 0")
