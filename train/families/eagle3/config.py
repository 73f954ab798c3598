"""EAGLE-3's drafter config and its fields of the run's `model` section.

Defaults are SpecForge's for Qwen3 targets (configs/qwen3-*-eagle3.json,
scripts/train_eagle3.py): the target's own attention geometry and intermediate size,
one decoder layer, a 32,000-token draft vocabulary, training-time test unrolled over 7
steps (`--ttt-length 7`), and the aux layers low / middle / high."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from transformers import LlamaConfig

from store_schema.layout import validate_layer_ids
from train.config_error import require

ARCHITECTURE = "eagle3"
DRAFT_VOCAB_SIZE = 32_000
TTT_STEPS = 7


@dataclass
class Eagle3Fields:
    """EAGLE-3's own keys of the run's `model` section."""

    draft_vocab_size: int = DRAFT_VOCAB_SIZE  # eagle3: the reply tokens it drafts (most frequent in the store)
    ttt_steps: int = TTT_STEPS  # eagle3: training-time test steps (SpecForge's --ttt-length 7)

    def validate_eagle3(self) -> None:
        require(self.draft_vocab_size >= 1, "model.draft_vocab_size", "must be >= 1")
        require(self.ttt_steps >= 1, "model.ttt_steps", "must be >= 1")


def aux_layers(stored: list[int]) -> list[int]:
    """Low / middle / high of the store's layers (DFlash's [1, 16, 31, 46, 61] -> [1, 31, 61])."""
    return [stored[0], stored[len(stored) // 2], stored[-1]]


@dataclass
class Eagle3Config:
    """Everything that fixes an EAGLE-3 drafter's shape and its contract with the target."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_target_layers: int
    context_layer_ids: list[int]  # the aux layers (this project's convention: output of layer L)
    ttt_steps: int = TTT_STEPS
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rope_parameters: dict = field(default_factory=dict)
    architecture: str = ARCHITECTURE

    def __post_init__(self):
        self.context_layer_ids = validate_layer_ids([int(i) for i in self.context_layer_ids], self.num_target_layers)
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size} (the target's)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")

    @property
    def num_hidden_layers(self) -> int:
        """Decoder layers: one (vLLM's `midlayer`, its KV cache sized as one layer's)."""
        return 1

    @property
    def num_context_layers(self) -> int:
        return len(self.context_layer_ids)

    @classmethod
    def from_target(cls, target, context_layer_ids: list[int], draft_vocab_size: int, ttt_steps: int, **overrides):
        """Sized for a `TargetConfig`: its attention geometry unless overridden (None keeps it);
        the draft vocabulary at most the target's."""
        fields = dict(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            num_target_layers=target.num_hidden_layers,
            context_layer_ids=list(context_layer_ids),
            ttt_steps=ttt_steps,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
        )
        if target.max_position_embeddings:
            fields["max_position_embeddings"] = target.max_position_embeddings
        fields.update({name: value for name, value in overrides.items() if value is not None})
        if fields["intermediate_size"] is None:
            raise ValueError("the target config has no intermediate_size (MoE?): set model.intermediate_size")
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict) -> "Eagle3Config":
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    def differences(self, other) -> list[str]:
        """'name: this vs other' for each field that differs (empty when equal)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{name}: {mine[name]!r} vs {theirs.get(name)!r}" for name in mine if mine[name] != theirs.get(name)]

    def llama_config(self) -> LlamaConfig:
        """The transformers LlamaConfig the layer's MLP and rotary embedding are built from.
        The attention is the drafter's own (its heads x `head_dim` need not equal the hidden
        size, as Qwen3.6's 24 x 256 do not 5120), so the config names one head of `head_dim`:
        transformers refuses a hidden size that is not a multiple of the heads."""
        rope = {"rope_type": "default", **self.rope_parameters, "rope_theta": self.rope_theta}
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            mlp_bias=False,
            rope_parameters=rope,
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
        )
