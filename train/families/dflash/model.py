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
- Full-attention layers see the block bidirectionally; sliding layers (the
  published drafters' first four) are causal inside the block and see only a
  window of context, exactly as z-lab's reference reads `layer_types`,
  `sliding_window` and `is_causal`. RoPE is absolute: context keys at their token
  positions, block tokens at anchor .. anchor+B-1.
- The target's `embed_tokens` and `lm_head` are frozen and live outside the
  drafter (see `train/target_head.py`); they are passed in, never saved here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import cast

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from store_schema.layout import default_layer_ids as default_context_layer_ids  # the one formula
from store_schema.layout import validate_layer_ids  # the one rule
from train.families.dflash.anchors import LayerAttention, block_position_ids
from train.families.dflash.attention import attend, build_attention_mask, resolve_attention
from train.families.dflash.flex_compile import FlexUnavailable
from train.families.dflash.geometry import BLOCK_SIZE, shape_problems
from train.families.dflash.variants import DEFAULT_KIND, DFLASH, DrafterKind, kind_named
from train.families.family import Drafter

# The published Qwen3.6-27B drafter's geometry (SpecForge configs/qwen3.6-27b-dflash.json,
# z-lab/Qwen3.6-27B-DFlash): the defaults `DrafterConfig.from_target` sizes a drafter with.
PUBLISHED_HEAD_DIM = 128
PUBLISHED_MAX_HEADS = 32  # hidden 5120 / 128 would be 40; the published drafter has 32 x 128
PUBLISHED_KV_HEADS = 8
PUBLISHED_LAYERS = 5
PUBLISHED_SLIDING_WINDOW = 2048


def published_layer_types(num_layers: int) -> list[str]:
    """The last layer full attention, the others sliding (z-lab's published layout)."""
    return ["sliding_attention"] * (num_layers - 1) + ["full_attention"]


def default_kv_heads(num_heads: int) -> int:
    """The largest divisor of `num_heads` that is at most 8 (8 for 32 heads)."""
    return max(d for d in range(1, min(num_heads, PUBLISHED_KV_HEADS) + 1) if num_heads % d == 0)


@dataclass
class DrafterConfig:
    """Everything that fixes the drafter's shape and its contract with the target.

    `from_target` sizes one for a target (published geometry by default); the drafter's
    hidden size must equal the target's. `layer_types` None means every layer full
    attention (drafters saved before sliding layers existed); `is_causal` None
    means the reference's per-layer default (see `layer_attention`)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    context_layer_ids: list[int]
    mask_token_id: int
    num_hidden_layers: int = PUBLISHED_LAYERS
    block_size: int = BLOCK_SIZE
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # kept only when a layer is sliding
    is_causal: bool | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rope_parameters: dict = field(default_factory=dict)  # extra rope fields, e.g. rope_type/factor
    # The kind (train.families.dflash.variants); a record written before kinds existed is DFlash (`from_dict`).
    architecture: str = DEFAULT_KIND.name
    # DFlash 2's sizes (train.families.dflash.variants.DFLASH2_SIZES), read only by the kinds that list them.
    conv_kernel_size: int = 2  # taps of each block-local convolution
    conv_group_size: int = 16  # channels that share one dynamic coefficient
    selector_rank: int = 256  # rank r of the selector's codebooks [V, r]
    selector_top_k: int = 16  # candidates the selector reranks per drafted position

    def __post_init__(self):
        self.context_layer_ids = validate_layer_ids([int(i) for i in self.context_layer_ids], self.num_target_layers)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary [0, {self.vocab_size}): "
                "the mask token must have a row in the target's embedding table"
            )
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        problems = shape_problems(asdict(self))  # the one rule, train/families/dflash/geometry.py
        if problems:
            raise ValueError(" ".join(problems[0]))
        if "sliding_attention" not in self.layer_types:
            self.sliding_window = None

    @property
    def kind(self) -> DrafterKind:
        return kind_named(self.architecture)

    @property
    def num_context_layers(self) -> int:
        return len(self.context_layer_ids)

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s rule as the reference (`dflash` 0.1.0) derives it: sliding
        layers are causal unless `is_causal` is set (which then applies to every
        layer) and use `sliding_window`; full layers have no window."""
        assert self.layer_types is not None  # __post_init__ fills it
        sliding = self.layer_types[layer] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return LayerAttention(causal=causal, window=self.sliding_window if sliding else None)

    @classmethod
    def from_target(
        cls,
        target,
        mask_token_id: int,
        context_layer_ids: list[int] | None = None,
        num_context_layers: int = 5,
        **overrides,
    ) -> "DrafterConfig":
        """Size a drafter for a `store_schema.runtime.target_config.TargetConfig`: the one place
        for the geometry defaults. Overrides that are None take the default:
        head_dim 128, heads hidden // 128 clamped to 1..32, KV heads the largest
        divisor of heads up to 8, the target's intermediate size, 5 layers, the last full
        attention and the others sliding with window 2048. Without explicit ids,
        z-lab's default spread over `num_context_layers` target layers."""
        overrides = {name: value for name, value in overrides.items() if value is not None}
        if context_layer_ids is None:
            context_layer_ids = default_context_layer_ids(target.num_hidden_layers, num_context_layers)
        head_dim = overrides.pop("head_dim", PUBLISHED_HEAD_DIM)
        heads = overrides.pop("num_attention_heads", min(PUBLISHED_MAX_HEADS, max(1, target.hidden_size // head_dim)))
        layer_types = overrides.pop("layer_types", None)
        num_layers = overrides.pop("num_hidden_layers", len(layer_types) if layer_types else PUBLISHED_LAYERS)
        fields = dict(
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=default_kv_heads(heads),
            head_dim=head_dim,
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            context_layer_ids=list(context_layer_ids),
            mask_token_id=mask_token_id,
            num_hidden_layers=num_layers,
            layer_types=layer_types or published_layer_types(num_layers),
            sliding_window=PUBLISHED_SLIDING_WINDOW,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
        )
        if target.max_position_embeddings:
            fields["max_position_embeddings"] = target.max_position_embeddings
        fields.update(overrides)
        if fields["intermediate_size"] is None:
            raise ValueError("the target config has no intermediate_size (MoE?): set model.intermediate_size")
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        """From `to_dict()` output, e.g. a checkpoint's; `num_layers` is the older
        spelling of `num_hidden_layers`; a record without `architecture` predates DFlash 2."""
        data = {"architecture": DFLASH.name, **data}
        if "num_layers" in data:
            data["num_hidden_layers"] = data.pop("num_layers")
        return cls(**data)

    @classmethod
    def from_state(cls, state: dict) -> "DrafterConfig":
        """The drafter a checkpoint holds, from its state.json (`train.fitting.checkpoint.read_state`)."""
        return cls.from_dict(state["drafter_config"])

    def differences(self, other: "DrafterConfig") -> list[str]:
        """'name: this vs other' for each field that differs (empty when equal)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{name}: {mine[name]!r} vs {theirs[name]!r}" for name in mine if mine[name] != theirs[name]]

    def qwen3_config(self) -> Qwen3Config:
        """The transformers Qwen3Config the drafter's layers are built from."""
        rope = {"rope_type": "default", **self.rope_parameters, "rope_theta": self.rope_theta}
        assert self.layer_types is not None  # __post_init__ fills it
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
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
            layer_types=list(self.layer_types),
            use_sliding_window=self.sliding_window is not None,
            sliding_window=self.sliding_window,
            max_window_layers=self.num_hidden_layers,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, L, D] by per-position cos/sin [b, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context | block]; queries from the block.
    `rule` is this layer's causal/window rule (full or sliding)."""

    def __init__(self, config: DrafterConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rule = config.layer_attention(layer)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask):
        """x [b, Q, H] block tokens; context [b, T, H]; cos/sin [b, T+Q, D] for the
        keys (queries use the last Q rows); mask: from `train.families.dflash.attention.build_attention_mask`
        for this layer's rule, or None (every key visible)."""
        b, q_len, _ = x.shape
        out = attend(*self.queries_keys_values(x, context, cos, sin), mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    def queries_keys_values(self, x, context, cos, sin):
        """q [b, heads, Q, D] and k, v [b, kv_heads, T+Q, D], all in v's dtype. Under
        bf16 autocast the projections are bf16 but the q/k norms compute in fp32 and
        return fp32; flex attention refuses mixed dtypes on older torch and its compiled
        backward can fail on them (PyTorch #176025), so q and k follow v after RoPE."""
        b, q_len, _ = x.shape
        kv_input = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(b, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_input).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(k, cos, sin)
        return q.to(v.dtype), k.to(v.dtype), v


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only the block tokens flow through the residual."""

    def __init__(self, config: DrafterConfig, qwen3_config: Qwen3Config, layer: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer)
        self.mlp = Qwen3MLP(qwen3_config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = config.block_size

    def forward(self, x, context, cos, sin, mask):
        """x [1, N*B, H]: the N blocks of a training forward (or one block)."""
        return self.sublayers(x, lambda normed: self.self_attn(normed, context, cos, sin, mask), self.block_size)

    def sublayers(self, x, attention, block_size: int):
        """The residual stream through `attention` (the normed block -> its attention
        output) and the MLP. x [..., L, H] holds whole blocks of `block_size` rows
        (DFlash ignores them; DFlash 2's convolutions stay inside each)."""
        x = x + attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(Drafter):
    """The drafter. `state_dict()` keys are exactly z-lab's checkpoint names."""

    config: DrafterConfig

    kind = DFLASH
    layer_class = DFlashDecoderLayer

    def __init__(self, config: DrafterConfig):
        if config.kind is not self.kind:
            raise ValueError(
                f"{type(self).__name__} is a {self.kind.name} drafter; the config is {config.architecture}"
            )
        super().__init__()
        self.config = config
        qwen3_config = config.qwen3_config()
        hidden = config.hidden_size
        self.layers = nn.ModuleList(self.layer_class(config, qwen3_config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_context_layers * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        # inv_freq is a non-persistent buffer: not in the state dict, as in z-lab's.
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3_config)
        self.gradient_checkpointing = False
        self.reset_parameters()

    @property
    def decoder_layers(self) -> list[DFlashDecoderLayer]:
        """`layers` as what they are (nn.ModuleList types its items as Module)."""
        return cast(list[DFlashDecoderLayer], list(self.layers))

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
        attention: "split" (context and own block attended apart, one softmax),
            "sdpa" (dense boolean mask), "flex" (flex_attention BlockMask), or
            "auto" (flex on CUDA, split elsewhere); see train/families/dflash/attention.py.
        Returns final hidden states [N, B, H] after `norm`; apply the target's
        lm_head to get logits (see train/families/dflash/loss.py)."""
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

        try:
            x = self.decode_layers(x, context, cos, sin, self.attention_masks(anchor_positions, length, attention))
        except FlexUnavailable:  # said once (flex_compile.give_up_flex); this forward again on the split path
            x = self.decode_layers(x, context, cos, sin, self.attention_masks(anchor_positions, length, "split"))
        return self.norm(x).view(num_blocks, block, cfg.hidden_size)

    def decode_layers(self, x, context, cos, sin, masks: dict) -> torch.Tensor:
        """The decoder layers over the blocks `x` [1, N*B, H], each with its rule's mask."""
        for layer in self.decoder_layers:
            mask = masks[layer.self_attn.rule]
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, context, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, context, cos, sin, mask)
        return x

    @property
    def path_top_k(self) -> int:
        """Candidates per drafted slot that `drafted_path` reads (DFlash: each slot's top-1)."""
        return 1

    def greedy_tokens(self, hidden: torch.Tensor, anchor_id: int, lm_head: nn.Linear) -> torch.Tensor:
        """The drafted tokens [L] of one block's drafted slots (`hidden` [L, H], after
        `norm`) at greedy decoding: each slot's argmax through the target's lm_head."""
        return lm_head(hidden.to(lm_head.weight.dtype)).argmax(dim=-1)

    def sampled_tokens(self, hidden: torch.Tensor, anchor_id: int, lm_head: nn.Linear, sampling, generator):
        """The drafted tokens at temperature (`sampling`: train.sampling.Sampling):
        each slot drawn from the drafter's own processed distribution, as the reference's
        `dflash_generate` draws. -> (tokens [L], their distributions [L, V], None: over
        the whole vocabulary)."""
        probs = sampling.probs(lm_head(hidden.to(lm_head.weight.dtype)))
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs, None

    def drafted_path(
        self, hidden: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor, anchor_ids: torch.Tensor
    ) -> torch.Tensor:
        """What `greedy_tokens` drafts, from each drafted slot's top candidates already
        taken (`top_values`, `top_ids` [b, L, K >= path_top_k]; `hidden` [b, L, H];
        `anchor_ids` [b]) -> [b, L]: evaluation's path, without the [b, L, V] logits.
        DFlash: each slot's top-1."""
        return top_ids[..., 0]

    def attention_masks(self, anchor_positions: torch.Tensor, context_len: int, attention: str = "auto") -> dict:
        """One mask per distinct layer rule (full, sliding), built once per forward."""
        kind = resolve_attention(attention, anchor_positions.device)
        rules = {layer.self_attn.rule for layer in self.decoder_layers}
        cfg = self.config
        return {
            rule: build_attention_mask(
                kind, anchor_positions, context_len, cfg.block_size, rule, cfg.num_attention_heads
            )
            for rule in rules
        }
