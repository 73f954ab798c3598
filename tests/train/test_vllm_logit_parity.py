"""vLLM's own DFlash drafter (vllm/model_executor/models/qwen3_dflash.py) drafts the
same logits as this project's, in fp32, for the first block of one prompt.

tests/vllm_scripts/vllm_logits.py runs a real vLLM engine (CPU build, in its own
process) with an exported random drafter as its speculator and saves what vLLM's
drafter was given and what it drafted on its first round: the target's hidden
states of the whole prompt as context, the block [bonus token, MASK x K] at
positions P .. P+K (P = prompt length, the bonus token the anchor, which is not in
the context), and its K draft logits. Here the target's features are recomputed with
transformers and the block is drafted by `DraftCache` (what `speculate` runs) and by
the training forward; both must match vLLM's logits within 1e-4 and pick the same
tokens. The same drafter read under a different attention rule must not: so the
tolerance tells the rules apart, and the rule vLLM serves is the one trained.
The random export is tests/train/random_drafters.py's (2 heads of 32, vLLM's CPU size).
"""

from __future__ import annotations

import copy

import pytest
import torch
from random_drafters import random_export
from reference_oracle import BLOCK
from served import captured_first_round

from store_schema.runtime.target_model import load_target_model
from train.decoding.target_decode import TargetSession
from train.export.drafter_dir import load_drafter
from train.families.dflash.anchors import LayerAttention
from train.families.dflash.draft_cache import DraftCache
from train.families.family import Served

DFLASH_SERVED = Served("DFlash", "DFlashDraftModel", "dflash", BLOCK, mixed_layers=False, cpu_serves=True)
TOLERANCE = 1e-4
PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]  # longer than the sliding window below
LAYOUTS = {
    "full": dict(num_hidden_layers=1, layer_types=["full_attention"]),
    "sliding": dict(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=4),
    # The published DFlash 2's rule (is_causal false): sliding layers that see their whole block.
    "noncausal": dict(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=4, is_causal=False),
}
# The same weights under a rule vLLM does not serve them with: a causal block for a
# full layer, no window for a sliding one.
OTHER_RULE = {
    "full": LayerAttention(causal=True),
    "sliding": LayerAttention(causal=True, window=None),
    "noncausal": LayerAttention(causal=True, window=4),
}


def drafted_logits(drafter, model, features, block) -> dict[str, torch.Tensor]:
    """The block's draft logits (slots 1..) by the decode-time cache and by the training forward."""
    cache = DraftCache(drafter, model.get_input_embeddings())
    cache.extend(features)
    sequence = torch.cat([torch.tensor(PROMPT), block[:1]])  # the anchor's own features are masked out
    padded = torch.cat([features, torch.zeros(1, features.shape[1])])
    trained = drafter(padded, sequence, torch.tensor([len(PROMPT)]), model.get_input_embeddings())[0]
    lm_head = model.get_output_embeddings()
    return {"draft_cache": lm_head(cache.draft(block)[1:]), "training_forward": lm_head(trained[1:])}


@pytest.mark.slow  # vLLM runs in a child process
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@torch.no_grad()
def test_vllm_drafts_the_same_logits_as_the_project(layout, target_dir, mask_id, vllm_python, tmp_path):
    export = random_export(target_dir, mask_id, tmp_path / "drafter", **LAYOUTS[layout])
    served = captured_first_round(vllm_python, target_dir, export, DFLASH_SERVED, PROMPT, tmp_path / "vllm")
    model = load_target_model(target_dir, torch.device("cpu"), torch.float32).model.eval()
    drafter = load_drafter(export, dtype=torch.float32).eval()
    config = drafter.config

    logits, features = TargetSession(model, config.context_layer_ids).forward(torch.tensor(PROMPT), features=True)
    assert (served["target_features"] - features).abs().max() < TOLERANCE  # vLLM's target agrees with transformers
    prompt_length, drafts = len(PROMPT), BLOCK - 1
    assert served["context_positions"].tolist() == list(range(prompt_length))  # the anchor is not in the context
    block = torch.tensor([int(logits[-1].argmax())] + [config.mask_token_id] * drafts)
    assert served["block_ids"].tolist() == block.tolist()
    assert served["block_positions"].tolist() == list(range(prompt_length, prompt_length + BLOCK))

    vllm_logits = served["draft_logits"]
    assert vllm_logits.shape == (drafts, config.vocab_size)
    for path, ours in drafted_logits(drafter, model, features, block).items():
        assert (ours - vllm_logits).abs().max() < TOLERANCE, path
        assert torch.equal(ours.argmax(-1), vllm_logits.argmax(-1)), path

    other = copy.deepcopy(drafter)
    for layer in other.layers:
        layer.self_attn.rule = OTHER_RULE[layout]
    assert (drafted_logits(other, model, features, block)["draft_cache"] - vllm_logits).abs().max() > 100 * TOLERANCE
