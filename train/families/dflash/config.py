"""The run config's sections the drafter families own: `model` (the drafter's shape,
checked by its family's shape rule, and how it is trained and run) and `loss` (what the
training step minimises); `train/config.py` composes them into the run's."""

from __future__ import annotations

from dataclasses import dataclass

from train.config_error import ConfigError, require
from train.evaluation.config import LABELS
from train.families.dflash.geometry import ATTENTION_KINDS, shape_problems
from train.families.dflash.variants import DEFAULT_KIND, DFLASH2_SIZES, KINDS

ARCHITECTURES = tuple(KINDS)  # the `model.architecture` values this section describes


@dataclass
class ModelConfig:
    # Drafter geometry; None takes DrafterConfig.from_target's default (the published
    # Qwen3.6-27B drafter's: head_dim 128, hidden // 128 heads up to 32, up to 8 KV heads,
    # the target's intermediate size, 5 layers [sliding x4, full], window 2048).
    num_hidden_layers: int | None = None  # drafter decoder layers (default 5, or len(layer_types))
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    layer_types: list[str] | None = None  # per layer: full_attention or sliding_attention
    sliding_window: int | None = None  # context window of the sliding layers
    block_size: int | None = None  # B: anchor + B-1 drafted tokens; None: the published layout's, else 16
    causal: bool | None = None  # every layer causal (True) or not (False); None: the layout's, else per layer kind
    target_layer_ids: list[int] | None = None  # the store's layers the drafter reads; None: the layout's taps, else all
    # The drafter kind (train.families.dflash.variants): "dflash2" (DFlash + block-local convolutions and a
    # candidate selector) or "dflash"; why the default is what it is: README, "Which drafter"
    architecture: str = DEFAULT_KIND.name
    conv_kernel_size: int | None = None  # dflash2 sizes; None takes DrafterConfig's default (2, 16, 256, 16)
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    mask_token_id: int | None = (
        None  # None: resolved by train.families.dflash.mask_token's rules (the run records the id and rule)
    )
    init_from: str | None = None  # a z-lab-format drafter directory to fine-tune from (train.families.dflash.init_from)
    num_anchors: int = 512  # blocks per sequence, redrawn every step
    attention: str = "auto"  # "auto" (flex on CUDA, split elsewhere), "split", "sdpa", "flex"
    gradient_checkpointing: bool = False

    def validate(self):
        problems = shape_problems(self.geometry(), prefix="model.")  # the drafter's rule
        if problems:
            key, problem = problems[0]
            raise ConfigError(f"config {key}: {problem}")
        require(self.mask_token_id is None or self.mask_token_id >= 0, "model.mask_token_id", "must be >= 0")
        require(self.num_anchors >= 1, "model.num_anchors", "must be >= 1")
        require(self.attention in ATTENTION_KINDS, "model.attention", f"must be one of {', '.join(ATTENTION_KINDS)}")

    def geometry(self) -> dict:
        """The drafter-shape overrides for `DrafterConfig.from_target` (None = its default)."""
        names = (
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "layer_types",
            "sliding_window",
            "block_size",
            "architecture",
            *DFLASH2_SIZES,
        )
        return {**{name: getattr(self, name) for name in names}, "is_causal": self.causal}


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
