"""The DFlash drafter: a few Qwen3 decoder layers that draft a block of B tokens at
once, conditioned on hidden states of chosen target layers.

Built from transformers' own Qwen3 pieces (RMSNorm, MLP, rotary embedding) the way
z-lab's `dflash/model.py` is, and with their parameter names, so an exported
drafter loads in their `DFlashDraftModel` and in vLLM / SGLang:

    fc.weight, hidden_norm.weight, norm.weight,
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
    layers.{i}.mlp.{gate,up,down}_proj.weight,
    layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight

What makes it DFlash rather than a small Qwen3:
- `fc` + `hidden_norm` fold the concatenated target features [T, n_ctx*H] into one
  context stream [T, H].
- In every layer the context becomes extra keys/values through that layer's own
  k_proj / v_proj (+ k_norm), laid out as [context | block]. Queries come only
  from the block, and the context never enters the residual stream.
- Attention inside a block is bidirectional. RoPE is absolute: context keys at
  their token positions, block tokens at anchor .. anchor+B-1.
- The target's `embed_tokens` and `lm_head` are frozen and live outside the
  drafter (see `train/target_head.py`); they are passed in, never saved here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from store_schema.layout import default_layer_ids as default_context_layer_ids  # the one formula
from store_schema.layout import validate_layer_ids  # the one rule
from train.anchors import block_position_ids, dense_attention_mask, dflash_mask_mod


@dataclass
class DrafterConfig:
    """Everything that fixes the drafter's shape and its contract with the target.

    Sizes (hidden, heads, head_dim, rope, eps) come from the target's config
    (`DrafterConfig.from_target`); drafter hidden size must equal the target's."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    context_layer_ids: list[int]
    mask_token_id: int
    num_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rope_parameters: dict = field(default_factory=dict)  # extra rope fields, e.g. rope_type/factor

    def __post_init__(self):
        self.context_layer_ids = validate_layer_ids([int(i) for i in self.context_layer_ids], self.num_target_layers)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary [0, {self.vocab_size}): "
                "the mask token must have a row in the target's embedding table"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def num_context_layers(self) -> int:
        return len(self.context_layer_ids)

    @classmethod
    def from_target(
        cls,
        target,
        mask_token_id: int,
        context_layer_ids: list[int] | None = None,
        num_context_layers: int = 5,
        **overrides,
    ) -> "DrafterConfig":
        """Size a drafter from a `store_schema.target_config.TargetConfig`. Without explicit
        ids, use z-lab's default spread over `num_context_layers` target layers."""
        if context_layer_ids is None:
            context_layer_ids = default_context_layer_ids(target.num_hidden_layers, num_context_layers)
        fields = dict(
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            context_layer_ids=list(context_layer_ids),
            mask_token_id=mask_token_id,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
        )
        if target.max_position_embeddings:
            fields["max_position_embeddings"] = target.max_position_embeddings
        fields.update(overrides)
        if fields["intermediate_size"] is None:
            raise ValueError("the target config has no intermediate_size (MoE?): pass intermediate_size= explicitly")
        return cls(**fields)

    def qwen3_config(self) -> Qwen3Config:
        """The transformers Qwen3Config the drafter's layers are built from."""
        rope = {"rope_type": "default", **self.rope_parameters, "rope_theta": self.rope_theta}
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            rope_parameters=rope,
            initializer_range=self.initializer_range,
            tie_word_embeddings=False,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, L, D] by per-position cos/sin [b, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale):
    """flex_attention, compiled on CUDA (the fused kernel); eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context | block]; queries from the block."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask):
        """x [b, Q, H] block tokens; context [b, T, H]; cos/sin [b, T+Q, D] for the
        keys (queries use the last Q rows); mask: bool [Q, T+Q] or a flex BlockMask."""
        b, q_len, _ = x.shape
        kv_input = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(b, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rope(k, cos, sin)
        scale = 1.0 / math.sqrt(self.head_dim)
        if mask is None or isinstance(mask, torch.Tensor):  # None: every key visible
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            out = _flex_attention(q, k, v, mask, scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only the block tokens flow through the residual."""

    def __init__(self, config: DrafterConfig, qwen3_config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(qwen3_config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter. `state_dict()` keys are exactly z-lab's checkpoint names."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        qwen3_config = config.qwen3_config()
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, qwen3_config) for _ in range(config.num_layers))
        self.fc = nn.Linear(config.num_context_layers * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        # inv_freq is a non-persistent buffer: not in the state dict, as in z-lab's.
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3_config)
        self.gradient_checkpointing = False
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """Keep RoPE inverse frequencies in fp32 whatever dtype the weights are cast
        to, as inference engines compute them (a bf16 cast would blur positions)."""
        super()._apply(fn, recurse)
        if self.rotary_emb.inv_freq.dtype != torch.float32:
            device = self.rotary_emb.inv_freq.device
            self.rotary_emb = Qwen3RotaryEmbedding(self.rotary_emb.config).to(device)
        return self

    def reset_parameters(self):
        """Qwen's init: Linear ~ N(0, initializer_range), norms at 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        context_features: torch.Tensor,
        input_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        embed_tokens: nn.Module,
        attention: str = "auto",
    ) -> torch.Tensor:
        """Training forward for one sequence.

        context_features: [T, n_ctx*H] target features of the whole sequence, layers
            concatenated in `context_layer_ids` order.
        input_ids: [T] the sequence's tokens (the anchor tokens are read from here).
        anchor_positions: [N] int64, each in [0, T); block j is
            [input_ids[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1.
        embed_tokens: the target's frozen embedding (e.g. TargetHead.embed_tokens).
        attention: "sdpa" (dense boolean mask), "flex" (flex_attention BlockMask),
            or "auto" (flex on CUDA, sdpa elsewhere).
        Returns final hidden states [N, B, H] after `norm`; apply the target's
        lm_head to get logits (see train/loss.py)."""
        cfg = self.config
        block = cfg.block_size
        length = input_ids.shape[0]
        if context_features.shape != (length, cfg.num_context_layers * cfg.hidden_size):
            raise ValueError(
                f"context_features must be [T={length}, {cfg.num_context_layers}*{cfg.hidden_size}], "
                f"got {tuple(context_features.shape)}"
            )
        anchor_positions = anchor_positions.to(device=input_ids.device, dtype=torch.long)
        num_blocks = anchor_positions.numel()
        dtype = self.fc.weight.dtype
        if num_blocks == 0:
            return torch.zeros(0, block, cfg.hidden_size, dtype=dtype, device=input_ids.device)

        context = self.hidden_norm(self.fc(context_features.to(dtype)))[None]  # [1, T, H]

        block_ids = torch.full((num_blocks, block), cfg.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[:, 0] = input_ids[anchor_positions]
        x = embed_tokens(block_ids).to(dtype).reshape(1, num_blocks * block, cfg.hidden_size)

        key_positions = torch.cat(
            [torch.arange(length, device=input_ids.device), block_position_ids(anchor_positions, block).flatten()]
        )
        cos, sin = self.rotary_emb(x, key_positions[None])

        mask = self.attention_mask(anchor_positions, length, attention)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, context, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, context, cos, sin, mask)
        return self.norm(x).view(num_blocks, block, cfg.hidden_size)

    def attention_mask(self, anchor_positions: torch.Tensor, context_len: int, attention: str = "auto"):
        """The DFlash mask (train/anchors.py) as SDPA's bool tensor or a flex BlockMask."""
        block = self.config.block_size
        if attention == "auto":
            attention = "flex" if anchor_positions.is_cuda else "sdpa"
        if attention == "sdpa":
            return dense_attention_mask(anchor_positions, context_len, block)
        if attention == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            num_queries = anchor_positions.numel() * block
            return create_block_mask(
                dflash_mask_mod(anchor_positions, context_len, block),
                B=None,
                H=None,
                Q_LEN=num_queries,
                KV_LEN=context_len + num_queries,
                device=anchor_positions.device,
            )
        raise ValueError(f"attention must be 'auto', 'sdpa' or 'flex', got {attention!r}")
