"""DFlash's blocks for offline acceptance: each block drafted exactly as in training
(context features strictly before the anchor, `[anchor, MASK x (B-1)]`), its slots
1..B-1 scored through the target's frozen lm_head against the reference continuation
(`train.evaluation.evaluate` rolls them out)."""

from __future__ import annotations

import torch

from train.families.dflash.config import LossConfig
from train.families.dflash.targets import block_targets
from train.families.family import DraftedBlocks
from train.measures import chain_accepted
from train.target_head import head_topk


def draft_blocks(
    drafter, head, sample, features: torch.Tensor, positions: torch.Tensor, config, k: int, attention: str = "auto"
) -> DraftedBlocks:
    """Draft and score the blocks of one sample anchored at `positions` [N] (`config`:
    the run's `eval` section: labels, batch_blocks)."""
    block_size = drafter.config.block_size
    device = drafter.fc.weight.device
    input_ids = sample.input_ids.long().to(device)
    if config.labels == "target" and sample.topk_ids is None:
        raise ValueError(f"sample {sample.sample_id}: labels='target' needs stored top-k ids")
    # Weights are unused here; decay at gamma=1 only satisfies block_targets for any B.
    scoring = LossConfig(labels=config.labels, position_weights="decay", gamma=1.0)
    targets = block_targets(
        input_ids, sample.loss_mask.to(device), positions.to(device), block_size, scoring, sample.topk_ids
    )
    reference, valid = targets.labels[:, 1:], targets.valid[:, 1:]
    logprobs, ids, paths = [], [], []
    for start in range(0, positions.numel(), config.batch_blocks):
        batch = positions[start : start + config.batch_blocks].to(device)
        hidden = drafter(features, input_ids, batch, head.embed_tokens, attention=attention)
        top_logits, top_ids, normalizer = head_topk(hidden[:, 1:], head.lm_head.weight, max(k, drafter.path_top_k))
        paths.append(drafter.drafted_path(hidden[:, 1:], top_logits, top_ids, input_ids[batch]).cpu())
        logprobs.append((top_logits[..., :k] - normalizer).cpu())
        ids.append(top_ids[..., :k].cpu())
    all_ids = torch.cat(ids)
    reference, valid = reference.cpu(), valid.cpu()
    return DraftedBlocks(
        positions,
        reference,
        valid,
        torch.cat(logprobs),
        all_ids,
        accepted=chain_accepted(torch.cat(paths), reference, valid),
        unary_accepted=chain_accepted(all_ids[..., 0], reference, valid),
    )
