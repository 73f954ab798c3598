"""EAGLE-3's side of speculative decoding: each round a chain of tokens drafted one
at a time, as vLLM's EAGLE proposer drafts them.

The session keeps the first step's keys/values of every chain whose next token is
known (chain t: the target's features at t and the token x(t+1), at position t).
A round starts at the last verified position n-1 with the anchor x(n): step 0 there,
then each later step feeds back the previous output (before `norm`) and the token just
drafted, one position further, attending to the cached keys and its own chain's —
what training-time test trains (`train.families.eagle3.model`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from train.families.family import DraftSession
from train.sampling import Draft, Sampling, sample


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [heads, 1, D] over every key k, v [kv_heads, n, D]."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    weights = torch.softmax((q @ k.transpose(1, 2)).float() / math.sqrt(q.shape[-1]), dim=-1)
    return weights.to(v.dtype) @ v


class ChainDraftSession(DraftSession):
    def __init__(self, drafter, embed_tokens: nn.Embedding, round_tokens: int):
        self.drafter, self.embed_tokens = drafter, embed_tokens  # the drafter has its own lm_head
        self.round_tokens = round_tokens
        self.hidden = torch.zeros(0, drafter.config.hidden_size, dtype=self.dtype, device=self.device)
        self.tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self.keys: torch.Tensor | None = None  # step-0 keys/values of chains 0..committed-1
        self.values: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    @property
    def committed(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    @torch.no_grad()
    def extend(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        expected = self.drafter.config.num_context_layers * self.drafter.config.hidden_size
        if features.dim() != 2 or features.shape[-1] != expected:
            raise ValueError(f"context features must be [n, {expected}], got {tuple(features.shape)}")
        self.hidden = torch.cat([self.hidden, self.drafter.fc(features.to(self.device, self.dtype))])
        self.tokens = torch.cat([self.tokens, tokens.to(self.device).long()])
        start, stop = self.committed, self.tokens.shape[0] - 1  # chains whose next token is known
        if stop > start:
            positions = torch.arange(start, stop, device=self.device)
            _, k, v = self.project(self.tokens[start + 1 : stop + 1], self.hidden[start:stop], positions)
            self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=1)
            self.values = v if self.values is None else torch.cat([self.values, v], dim=1)

    def project(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        layer = self.drafter.midlayer
        embeds = self.embed_tokens(tokens).to(self.dtype)
        cos, sin = self.drafter.rope(positions, hidden)
        return layer.self_attn.project(layer.rows(embeds, hidden), cos, sin)

    @torch.no_grad()
    def chain(self, anchor_id: int, size: int, choose) -> torch.Tensor:
        """Target-vocabulary logits [size - 1, V] of the chain drafted after the
        anchor, each step's token `choose(logits [V])` (a target id)."""
        last = self.tokens.shape[0] - 1
        if last < 0:
            raise ValueError("extend() the session with the prompt's features before drafting")
        keys, values = self.keys, self.values
        if keys is None or values is None:  # a one-token prompt: no chain before the anchor's
            keys = values = self.hidden.new_zeros(
                self.drafter.config.num_key_value_heads, 0, self.drafter.config.head_dim
            )
        hidden, token, rows = self.hidden[last : last + 1], anchor_id, []
        for step in range(size - 1):
            position = torch.tensor([last + step], device=self.device)
            q, k, v = self.project(torch.tensor([token], device=self.device), hidden, position)
            keys, values = torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)
            hidden = self.drafter.midlayer.finish(attend(q, keys, values), hidden)
            logits = self.drafter.target_logits(self.drafter.lm_head(self.drafter.norm(hidden)))[0]
            rows.append(logits)
            token = int(choose(logits))
        return torch.stack(rows) if rows else torch.zeros(0, self.drafter.config.vocab_size, device=self.device)

    def draft(self, anchor_id: int, size: int, sampling: Sampling, generator) -> Draft:
        drawn: list[int] = []
        probs: list[torch.Tensor] = []

        def choose(logits: torch.Tensor) -> int:
            if sampling.greedy:
                drawn.append(int(logits.argmax()))
            else:
                probs.append(sampling.probs(logits))
                drawn.append(int(sample(probs[-1], generator)))
            return drawn[-1]

        self.chain(anchor_id, size, choose)
        tokens = torch.tensor(drawn, dtype=torch.long, device=self.device)
        return Draft(tokens, torch.stack(probs) if probs else None)

    def position_logits(self, anchor_id: int, size: int) -> torch.Tensor:
        return self.chain(anchor_id, size, lambda logits: int(logits.argmax()))
