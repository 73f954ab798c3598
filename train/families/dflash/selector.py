"""DFlash 2's candidate selector (reference: `dflash` 0.1.0's `CandidateSelector`;
the same parameter names, as its `from_pretrained` and vLLM's `qwen3_dflash2` read them).

At each drafted position t of a block the drafter's logits (through the target's
frozen lm_head) give the top-K candidates with their unary logits. The selector
rescores candidate c given the token chosen before it (the anchor for the first
drafted slot):

    score(c) = logit(c) + < A[prev] * (W h_t), B[c] >

with `predecessor_codebook` A and `successor_codebook` B (both [V, r]) and
`hidden_projection` W ([r, H]), h_t the drafter's final hidden state. Decoding walks
the block greedily from the anchor (`walk`); training scores each candidate from
the teacher-forced predecessor (`pair_scores`, the loss's bilinear term, in fp32).
The walk scores edges as the reference's `select` and vLLM do, in the selector's own
dtype (`edge_scores`: bf16 for a bf16 drafter), so near ties go the way a server goes.

The successor codebook starts at 0, so a fresh selector picks the argmax of the
logits: a fresh DFlash 2 drafts what its DFlash backbone drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CODEBOOKS = ("predecessor_codebook", "successor_codebook")  # nn.Parameters, saved without a `.weight` suffix


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        self.top_k, self.init_std = top_k, init_std
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Qwen's init (N(0, init_std)) for A and W; B at 0 (module docstring)."""
        nn.init.normal_(self.predecessor_codebook, std=self.init_std)
        nn.init.normal_(self.hidden_projection.weight, std=self.init_std)
        nn.init.zeros_(self.successor_codebook)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-K unary logits (fp32) and their token ids, [..., K] each."""
        unary, ids = torch.topk(logits.float(), self.top_k, dim=-1)
        return unary, ids

    def pair_scores(
        self, hidden: torch.Tensor, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """The bilinear term <A[prev] * (W h), B[cand]> in fp32 (autocast off):
        hidden [N, H], predecessor_ids [N], candidate_ids [N, K] -> [N, K]. Added to
        the candidates' unary logits, it is the score the reference's `select` ranks."""
        with torch.autocast(hidden.device.type, enabled=False):
            projected = hidden.float() @ self.hidden_projection.weight.float().T  # [N, r]
            # F.embedding, not codebook[ids]: the index's backward on CPU adds float rows with
            # atomics across threads above 32K elements, in an order that differs run to run
            predecessor = F.embedding(predecessor_ids, self.predecessor_codebook).float()  # [N, r]
            successor = F.embedding(candidate_ids, self.successor_codebook).float()  # [N, K, r]
            return torch.einsum("nr,nkr->nk", predecessor * projected, successor)

    def edge_scores(
        self, hidden: torch.Tensor, predecessor_ids: torch.Tensor, candidate_ids: torch.Tensor
    ) -> torch.Tensor:
        """`pair_scores` as decoding computes it: in the selector's dtype, the projection
        first, as the reference's `select` (equal to `pair_scores` for an fp32 selector)."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        predecessor = F.embedding(predecessor_ids, self.predecessor_codebook)
        successor = F.embedding(candidate_ids, self.successor_codebook)
        return torch.einsum("nr,nkr->nk", predecessor * projected, successor)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The greedy path through a block: hidden [b, L, H] and logits [b, L, V] of the
        L drafted positions, anchor_ids [b] -> token ids [b, L]; each position takes
        its best-scoring candidate given the token chosen before it."""
        unary, ids = self.candidates(logits)
        return self.walk_candidates(hidden, unary, ids, anchor_ids)

    def walk_candidates(
        self, hidden: torch.Tensor, unary: torch.Tensor, ids: torch.Tensor, anchor_ids: torch.Tensor, choose=None
    ) -> torch.Tensor:
        """`walk` from each position's top-K logits already taken: unary [b, L, K] and
        ids [b, L, K], so `eval` walks without the [b, L, V] logits. Scores are summed in
        the selector's dtype (`edge_scores`); `choose(scores [b, K]) -> index [b]` picks
        a candidate (default: the best, the greedy walk)."""
        dtype = self.hidden_projection.weight.dtype
        unary, ids = unary[..., : self.top_k].to(dtype), ids[..., : self.top_k]
        previous = anchor_ids
        path = []
        for position in range(hidden.shape[1]):
            scores = unary[:, position] + self.edge_scores(hidden[:, position], previous, ids[:, position])
            index = scores.argmax(dim=-1) if choose is None else choose(scores)
            previous = ids[:, position].gather(-1, index[:, None])[:, 0]
            path.append(previous)
        return torch.stack(path, dim=1)

    def sample_walk(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float, generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The walk at temperature T > 0, as the reference's `select` samples: each position
        draws among its top-K candidates from softmax(score / T) (no top-p / top-k there).
        -> (path [b, L], candidate ids [b, L, K], the distributions drawn from [b, L, K])."""
        unary, ids = self.candidates(logits)
        drawn = []

        def draw(scores: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(scores.float() / temperature, dim=-1)
            drawn.append(probs)
            return torch.multinomial(probs, 1, generator=generator)[:, 0]

        path = self.walk_candidates(hidden, unary, ids, anchor_ids, draw)
        return path, ids[..., : self.top_k], torch.stack(drawn, dim=1)
