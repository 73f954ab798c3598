"""EAGLE-3's chains for offline acceptance: each round start drafted as training-time
test drafts it, every step fed the reference token before it. Along a greedy chain
that is exact up to the first wrong token, where acceptance stops anyway, so the
accepted lengths are those greedy decoding reaches (`train.evaluation.evaluate` rolls
them out)."""

from __future__ import annotations

import torch

from train.families.eagle3.step import chain_labels
from train.families.family import DraftedBlocks, StepSample
from train.measures import chain_accepted


@torch.no_grad()
def draft_blocks(
    drafter, head, sample, features: torch.Tensor, positions: torch.Tensor, config, k: int
) -> DraftedBlocks:
    """The chains of one sample at round starts `positions` [N] (chain p - 1), scored
    against its reference (`config`: the `eval` section's labels)."""
    device = drafter.fc.weight.device
    if config.labels == "target" and sample.topk_ids is None:
        raise ValueError(f"sample {sample.sample_id}: labels='target' needs stored top-k ids")
    steps = drafter.config.ttt_steps
    step_sample = StepSample(sample.input_ids.long().to(device), sample.loss_mask.to(device), features, sample.topk_ids)
    labels = chain_labels(drafter, step_sample, steps, config.labels == "target", soft=False)
    chains = (positions - 1).to(device)
    outputs = drafter(features, step_sample.input_ids, head.embed_tokens, steps)
    logprobs, ids = [], []
    for hidden in outputs:
        top = torch.log_softmax(drafter.lm_head(hidden[chains]).float(), dim=-1).topk(k, dim=-1)
        logprobs.append(top.values.cpu())
        ids.append(drafter.target_ids_of(top.indices).cpu())
    all_ids = torch.stack(ids, dim=1)
    reference, valid = labels.reference[chains].cpu(), labels.valid[chains].cpu()
    accepted = chain_accepted(all_ids[..., 0], reference, valid)
    return DraftedBlocks(positions, reference, valid, torch.stack(logprobs, dim=1), all_ids, accepted, accepted)
