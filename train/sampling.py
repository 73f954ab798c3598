"""Decoding at temperature: the settings, the processed distribution, and speculative
sampling's acceptance rule, with z-lab's `dflash_generate` semantics.

- `Sampling.probs`: logits / T, then top-k, then top-p (the smallest set of most likely
  tokens whose mass reaches p), renormalised: the distribution a server samples from.
  T = 0 is greedy decoding (argmax) and has no distribution.
- A drafted slot is sampled from the drafter's own distribution q at the same settings
  (DFlash 2: the selector's walk samples among its top-K candidates at T, without
  top-p / top-k, as the reference's `CandidateSelector.select` does).
- `rejection_sample` verifies a block: drafted token x at slot i is accepted with
  probability min(1, p(x) / q(x)) (p: the target's processed distribution there); the
  first rejection resamples from the residual max(0, p - q) renormalised; a block
  accepted whole takes a bonus token from the target's distribution after it.

Every committed token is then distributed exactly as sampling the target alone
(Leviathan et al. 2023, Chen et al. 2023): lossless in distribution, not token for
token. The suite checks that on the fixture targets (tests/train/test_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """`speculate`'s --temperature / --top-p / --top-k."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: no cut), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution [..., V] (fp32) of `logits` [..., V]."""
        if self.greedy:
            raise ValueError("greedy decoding (temperature 0) has no sampling distribution")
        scores = logits.float() / self.temperature
        vocab = scores.shape[-1]
        indices = None
        if 0 < self.top_k < vocab:
            scores, indices = torch.topk(scores, self.top_k, dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            ordered = ordered * (ordered.cumsum(dim=-1) - ordered < self.top_p)  # the most likely token always stays
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if indices is not None:
            probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, indices, probs)
        return probs

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


GREEDY = Sampling()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


@dataclass
class Draft:
    """A block's drafted tokens [L] with the distribution each was sampled from:
    `probs` [L, V] over the vocabulary, or [L, K] over `candidate_ids` [L, K] (DFlash 2).
    Greedy drafts carry no distribution."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None

    def distribution(self) -> torch.Tensor:
        """`probs`, which only a draft sampled at temperature carries."""
        if self.probs is None:
            raise ValueError("a greedy draft carries no distribution to accept or reject against")
        return self.probs

    def draft_probability(self) -> torch.Tensor:
        """q(x_i) of each drafted token [L]."""
        rows = self.tokens[:, None]
        if self.candidate_ids is None:
            return self.distribution().gather(-1, rows)[:, 0]
        return (self.distribution() * (self.candidate_ids == rows)).sum(-1)

    def residual(self, target_probs: torch.Tensor, slot: int) -> torch.Tensor:
        """max(0, p - q) at drafted slot `slot`, renormalised; p itself where it is all 0
        (q covers p: a rejection there has probability 0, kept for rounding)."""
        residual = target_probs.clone()
        if self.candidate_ids is None:
            residual.sub_(self.distribution()[slot])
        else:
            residual.scatter_add_(0, self.candidate_ids[slot], -self.distribution()[slot])
        residual.clamp_min_(0)
        total = residual.sum()
        return residual / total if total > 0 else target_probs


def rejection_sample(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """(drafted tokens accepted, the token after them) for one verified block:
    `target_probs` [L + 1, V] is the target's distribution after the anchor and after
    each drafted token (module docstring)."""
    drafted = draft.tokens.shape[0]
    p = target_probs[:drafted].gather(-1, draft.tokens[:, None])[:, 0]
    q = draft.draft_probability()
    uniform = torch.rand(q.shape, generator=generator, device=q.device)
    accepted = int((uniform * q < p).long().cumprod(0).sum())
    if accepted == drafted:
        return accepted, int(sample(target_probs[drafted], generator))
    return accepted, int(sample(draft.residual(target_probs[accepted], accepted), generator))
