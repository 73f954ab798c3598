"""DFlash's side of speculative decoding: each round one block `[anchor, MASK x (b-1)]`
drafted from the cached context (`draft_cache.DraftCache`), greedy per slot for
DFlash and along the candidate selector's path from the anchor for DFlash 2
(`greedy_tokens`), or sampled at temperature (`sampled_tokens`)."""

from __future__ import annotations

import torch
from torch import nn

from train.families.dflash.draft_cache import DraftCache
from train.families.family import DraftSession
from train.sampling import Draft, Sampling


class BlockDraftSession(DraftSession):
    def __init__(self, drafter, embed_tokens: nn.Embedding, lm_head: nn.Linear, round_tokens: int):
        self.drafter, self.lm_head = drafter, lm_head
        self.cache = DraftCache(drafter, embed_tokens)
        self.round_tokens = round_tokens
        self.device = embed_tokens.weight.device

    def extend(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        self.cache.extend(features)  # the block's own tokens, not the context's, are embedded

    def drafted_hidden(self, anchor_id: int, size: int) -> torch.Tensor:
        """The drafted slots' final hidden states [size - 1, H]."""
        block = torch.full((size,), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = anchor_id
        return self.cache.draft(block)[1:]

    def draft(self, anchor_id: int, size: int, sampling: Sampling, generator) -> Draft:
        hidden = self.drafted_hidden(anchor_id, size)
        if sampling.greedy:
            return Draft(self.drafter.greedy_tokens(hidden, anchor_id, self.lm_head))
        return Draft(*self.drafter.sampled_tokens(hidden, anchor_id, self.lm_head, sampling, generator))

    def position_logits(self, anchor_id: int, size: int) -> torch.Tensor:
        return self.lm_head(self.drafted_hidden(anchor_id, size).to(self.lm_head.weight.dtype))
