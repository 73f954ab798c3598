"""The run config's `model` section: the drafter's shape (checked by its one shape rule,
`train.drafter.geometry`) and how it is trained and run; `train/config.py` composes it
into the run's. `LABELS`: what a block's slots are scored against (`train.objective.targets`)."""

from __future__ import annotations

from dataclasses import dataclass

from train.config_error import ConfigError, require
from train.drafter.geometry import ATTENTION_KINDS, shape_problems
from train.drafter.kinds import DEFAULT_KIND, DFLASH2_SIZES

LABELS = ("tokens", "target")  # what blocks are scored against: the stored tokens, or the target's top-1


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
    # The drafter kind (train.drafter.kinds): "dflash2" (DFlash + block-local convolutions and a
    # candidate selector) or "dflash"; why the default is what it is: README, "Which drafter"
    architecture: str = DEFAULT_KIND.name
    conv_kernel_size: int | None = None  # dflash2 sizes; None takes DrafterConfig's default (2, 16, 256, 16)
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    mask_token_id: int | None = (
        None  # None: resolved by train.drafter.mask_token's rules (the run records the id and rule)
    )
    init_from: str | None = None  # a z-lab-format drafter directory to fine-tune from (train.fitting.init_from)
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
