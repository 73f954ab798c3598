"""The EAGLE-3 drafter: one Llama decoder layer over `[embed(token), fc(aux layers)]`
that drafts one token per step, autoregressively, with a draft vocabulary.

The layout is what vLLM's `llama_eagle3.py` serves (and SGLang's, and SpecForge's
trainer writes), so an export needs only renaming:

    fc.weight [H, n_aux*H], midlayer.hidden_norm.weight, midlayer.input_layernorm.weight,
    midlayer.self_attn.{q,k,v}_proj.weight [.., 2H], midlayer.self_attn.o_proj.weight,
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight,
    norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab], t2d [vocab]

One step at position t takes the token x(t+1)'s embedding and a hidden state: the
first step `fc` of the target's aux features at t, each later step the previous
step's output before the final norm (vLLM's `aux_output`); the output after `norm`
predicts x(t+2) through `lm_head` over the draft vocabulary, whose id d is target id
d + d2t[d]. The attention is the layer's own: a step's keys are kept, so step k at
position t sees the first step's keys at positions <= t and its own chain's keys of
steps 1..k (at t) — what training-time test unrolls (`ttt_attention`) and what
vLLM's KV cache holds while drafting. RoPE positions grow by one per step.

The target's `embed_tokens` is frozen and lives outside the drafter (see
`train/target_head.py`); the drafter has its own `lm_head` over the draft vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from train.families.eagle3.config import Eagle3Config
from train.families.family import Drafter


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [heads, L, D] by per-position cos/sin [L, D]."""
    return x * cos + rotate_half(x) * sin


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide `[embeds | hidden]` row."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        inputs, bias = 2 * config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(inputs, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(inputs, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(inputs, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [heads, L, D], k and v [kv_heads, L, D] of rows x [L, 2H] (RoPE applied)."""
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """o_proj of attended values [heads, L, D] -> [L, H]."""
        return self.o_proj(attended.transpose(0, 1).reshape(attended.shape[1], -1))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step k's attention in training-time test (k = len(keys) - 1), all positions at
    once: query t [heads, T, D] sees the first step's keys[0] at positions <= t and
    keys[1..k] at t itself (its own chain). fp32 softmax; GQA keys repeat per group."""
    heads, length, dim = q.shape
    groups = heads // keys[0].shape[0]
    k0, v0 = (t.repeat_interleave(groups, dim=0) for t in (keys[0], values[0]))
    scale = 1.0 / math.sqrt(dim)
    causal = (q @ k0.transpose(1, 2)).float() * scale  # [heads, T, T]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    own = [(q * k.repeat_interleave(groups, dim=0)).sum(-1, keepdim=True).float() * scale for k in keys[1:]]
    weights = torch.softmax(torch.cat([causal, *own], dim=-1), dim=-1).to(q.dtype)
    out = weights[..., :length] @ v0
    for j, v in enumerate(values[1:]):
        out = out + weights[..., length + j : length + j + 1] * v.repeat_interleave(groups, dim=0)
    return out


class Eagle3Layer(nn.Module):
    """vLLM's first (and here only) EAGLE-3 layer: input_layernorm on the embeddings,
    hidden_norm on the hidden state, both into attention; the hidden state itself is
    the residual."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        llama = config.llama_config()
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(llama)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention's input [L, 2H]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output before the model's final norm [L, H] (vLLM's `aux_output`)."""
        residual = self.self_attn.output(attended) + hidden
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Drafter(Drafter):
    config: Eagle3Config
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        # The draft vocabulary (train.families.eagle3.vocab): target id = draft id + d2t[draft id];
        # t2d marks the target ids the draft vocabulary holds.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.gradient_checkpointing = False
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """cos, sin [L, D] at `positions` [L]."""
        cos, sin = self.rotary_emb(like, positions[None])
        return cos[0].to(like.dtype), sin[0].to(like.dtype)

    def draft_ids_of(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids (-1 where the draft vocabulary lacks one)."""
        target_of_draft = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        table = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        table[target_of_draft] = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        return table[target_ids]

    def target_ids_of(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., d] as target-vocabulary logits [..., V]
        (-inf outside the draft vocabulary, as vLLM's `compute_logits` writes them)."""
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.target_ids_of(torch.arange(logits.shape[-1], device=logits.device)), logits)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, embed_tokens: nn.Module, steps: int):
        """Training-time test over one sequence: features [T, n_aux*H] and its tokens
        [T] -> per step k < `steps` the output after `norm` [T-1, H] at positions
        t = 0..T-2, predicting x(t+2+k) (rows whose input token lies past the end see
        the last token again; their labels are invalid)."""
        length = input_ids.shape[0] - 1
        hidden = self.fc(features[:length].to(self.fc.weight.dtype))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for step in range(steps):
            token_at = torch.arange(length, device=input_ids.device) + 1 + step
            embeds = embed_tokens(input_ids[token_at.clamp(max=length)]).to(hidden.dtype)
            positions = torch.arange(length, device=input_ids.device) + step
            hidden = self.step(embeds, hidden, positions, keys, values)
            outputs.append(self.norm(hidden))
        return outputs

    def step(self, embeds, hidden, positions, keys: list, values: list) -> torch.Tensor:
        """One training-time-test step: appends its keys/values, returns the output before `norm`."""
        layer = self.midlayer
        cos, sin = self.rope(positions, hidden)
        q, k, v = layer.self_attn.project(layer.rows(embeds, hidden), cos, sin)
        keys.append(k)
        values.append(v)
        if self.gradient_checkpointing and self.training:
            attended = torch.utils.checkpoint.checkpoint(
                ttt_attention, q, list(keys), list(values), use_reentrant=False
            )
        else:
            attended = ttt_attention(q, keys, values)
        return layer.finish(attended, hidden)
