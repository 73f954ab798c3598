"""DFlash 2's candidate-selector loss: a K-way cross-entropy over each drafted
slot's top-K unary candidates, scored from the teacher-forced predecessor.

At serving time the selector walks the block from the anchor: at slot k it
scores the K candidates of the drafter's logits as unary logit + <A[prev] * W h_k,
B[cand]> (`dflash` 0.1.0 `CandidateSelector.select`) and commits the best. Training
teacher-forces the walk: prev is the anchor token for slot 1, then the true
previous token (`BlockTargets.predecessors`), so every slot is scored in parallel.

A label outside the top-K is skipped: the row adds nothing to the selector loss
(its unary CE in the main loss is what brings the label into the top-K). The
selector can never pick such a label at decode time, so there is nothing to
select (NeMo AutoModel's DFlash 2 trainer does the same; speculators' stored
DFlash 2 code adds the bilinear score over the whole vocabulary instead, with no
top-K). Skipped rows are not renormalised away: the loss keeps the main loss's
row weights, so a slot weighs the same in both terms.

Memory: the candidates and their unary logits [rows, K] come from the chunked
main loss (`train.families.dflash.loss`), which keeps them from each chunk's logits; this
term adds K x r per row (the successor codebook rows of the candidates), never a
[rows, V] tensor.

Codebook gradients are sparse: a step touches only the predecessor rows of A
and the candidate rows of B (at most rows x (1 + K) of V), yet a dense AdamW
keeps 2 x V x r fp32 moments per codebook (0.51 GB each, 1.02 GB for both at
V = 248,320, r = 256; the 27B drafter's whole AdamW state is ~15.4 GB) and
updates every row each step. Recommendation: keep A and B dense parameters in
the run's one AdamW (fused). Measured on the 2-core CPU for one codebook and one
sequence's 512 x 15 rows x (1 + 16) uniform ids (~101K distinct rows;
`benchmarks/codebook_optim_bench.py`, benchmarks/RESULTS.md 2026-12-02): dense
backward 1.4 s + fused AdamW step 0.19 s (foreach 1.7 s), against SparseAdam on
`nn.Embedding(sparse=True)` 0.32 s + 4.1 s. SparseAdam's moments are dense as
well (no memory saved), its lazy moments are not AdamW's, and sparse gradients
would need their own path through grad clipping and the `--nproc` all-reduce
(NCCL has no sparse all-reduce). A batch of sequences touches more rows still."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.families.dflash.selector import CandidateSelector


@dataclass
class SelectorOutput:
    """loss: the weighted K-way CE (a 0-dim tensor). in_topk [M]: the label is
    among the row's candidates. hit [M]: the selector's argmax is the label."""

    loss: torch.Tensor
    in_topk: torch.Tensor
    hit: torch.Tensor


def selector_weight_at(step: int, weight: float, warmup_steps: int) -> float:
    """Selector loss weight at optimizer step `step` (0-based): `weight`, ramped
    linearly over the first `warmup_steps` ((step + 1) / warmup, as the LR's
    warmup in train.fitting.schedule; 0 warm-up steps: `weight` throughout)."""
    if warmup_steps > 0 and step < warmup_steps:
        return weight * (step + 1) / warmup_steps
    return weight


def selector_loss(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    unary: torch.Tensor,
    candidates: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    weights: torch.Tensor,
) -> SelectorOutput:
    """The selector's loss over M scored rows.

    selector: has `pair_scores(hidden [M, H], predecessor_ids [M], candidate_ids
        [M, K]) -> [M, K]` (train.families.dflash.selector).
    hidden [M, H]: the drafter's hidden states the unary logits came from.
    unary [M, K] / candidates [M, K]: the top-K logits and their token ids; the
        gradient of `unary` reaches `hidden` through the head (the chunked loss).
    labels [M], predecessors [M]: each row's label and teacher-forced predecessor.
    weights [M]: the main loss's row weights (position weights, normalised)."""
    compute = torch.promote_types(unary.dtype, torch.float32)
    scores = unary.to(compute) + selector.pair_scores(hidden, predecessors, candidates).to(compute)
    match = candidates == labels[:, None]
    in_topk = match.any(1)
    target = match.long().argmax(1)  # index of the label among the candidates (0 when absent: masked below)
    row_loss = -scores.log_softmax(-1).gather(1, target[:, None]).squeeze(1)
    loss = (row_loss * weights.to(compute) * in_topk).sum()
    hit = candidates.gather(1, scores.argmax(1, keepdim=True)).squeeze(1) == labels
    return SelectorOutput(loss=loss, in_topk=in_topk.detach(), hit=hit.detach())
