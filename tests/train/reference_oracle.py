"""z-lab's reference drafter as the oracle: loaded with every tensor in place, one
block's logits as its decoder computes them, and the fixed inputs the comparisons share."""

from __future__ import annotations

import torch
from dflash.model import DFlashDraftModel

BLOCK, T = 8, 56
ANCHORS = [0, 1, 5, 13, 30, 47, T - BLOCK]  # anchor 0: no context; the last: block ends at T


def reference_logits(reference, head, features, input_ids, anchor):
    """The reference's forward on one block, as its decoder calls it on the first
    round: the context is the features of positions < anchor, no cache."""
    block = torch.full((1, BLOCK), reference.mask_token_id)
    block[0, 0] = input_ids[anchor]
    hidden = reference(
        position_ids=torch.arange(anchor + BLOCK)[None],
        noise_embedding=head.embed_tokens(block),
        target_hidden=features[:anchor][None],
    )
    return head.lm_head(hidden)[0]


def inputs(seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(T, 2 * 64, generator=generator), torch.randint(0, 512, (T,), generator=generator)


def load_reference(path, model_class=DFlashDraftModel) -> DFlashDraftModel:
    """The reference's `model_class` (DFlashDraftModel or DFlash2DraftModel) from `path`,
    in fp32, with every tensor in place."""
    reference, info = model_class.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return reference.eval()
