"""z-lab's reference drafter as the oracle: loaded with every tensor in place, one
block's logits as its decoder computes them, and the fixed inputs the comparisons share."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from dflash import model as dflash_model
from dflash.model import DFlashDraftModel
from transformers import AutoModelForCausalLM

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


def load_model(path):
    """A tiny target in fp32, as the decoders compare it."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def reference_generate(reference, model, prompt, max_new_tokens, **sampling):
    """`dflash_generate` with the reference drafter `reference` (DFlash or DFlash 2),
    greedy or at `sampling` (temperature, top_p, top_k; it draws from torch's global RNG).
    Its stats timer calls torch.cuda.synchronize, which a CPU build of torch refuses:
    only that timer is replaced by the plain clock."""
    clock = dflash_model._cuda_time
    dflash_model._cuda_time = time.perf_counter
    try:
        return dflash_model.dflash_generate(
            reference, model, prompt[None], max_new_tokens, None, return_stats=True, **sampling
        )
    finally:
        dflash_model._cuda_time = clock


def reference_decode(export_dir, model, prompt, max_new_tokens, **sampling):
    """z-lab's `dflash_generate` on the same export (DFlash or DFlash 2, as its
    config.json names it) and target, greedy or at `sampling`."""
    architecture = json.loads((Path(export_dir) / "config.json").read_text())["architectures"][0]
    reference = getattr(dflash_model, architecture).from_pretrained(str(export_dir), dtype=torch.float32).eval()
    return reference_generate(reference, model, prompt, max_new_tokens, **sampling)
