"""Rules of the CUDA-only paths that a CPU can check (issue 27.7): the exactness rule
of `speculate` in bf16, context noise drawn where the features are, fp16 refused."""

from __future__ import annotations

import pytest
import torch

from train.config_error import ConfigError
from train.config_loading import load_config
from train.context_noise import add_context_noise
from train.decoding.speculate import (
    NEAR_TIE_LOGIT_GAP,
    Decoded,
    PromptResult,
    describe_rule,
    mismatch_allowed,
    summarize,
)


def test_speculate_is_exact_in_fp32_and_forgives_only_near_ties_in_bf16():
    assert NEAR_TIE_LOGIT_GAP == 0.5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert mismatch_allowed(True, None, dtype)
    assert not mismatch_allowed(False, 0.01, torch.float32)  # fp32/CPU: exact, whatever the gap
    assert mismatch_allowed(False, 0.0, torch.bfloat16) and mismatch_allowed(False, 0.5, torch.bfloat16)
    assert mismatch_allowed(False, 0.3, torch.float16)
    assert not mismatch_allowed(False, 0.51, torch.bfloat16)  # a real disagreement: a decoding bug
    assert not mismatch_allowed(False, None, torch.bfloat16)  # outputs differ with no gap to show
    assert describe_rule(torch.float32) == "exact" and "0.5" in describe_rule(torch.bfloat16)

    def prompt(tokens, gap=None):
        return PromptResult("p", 4, Decoded(tokens, 1, 1.0, [len(tokens)]), Decoded([1, 2, 3], 3, 1.0), gap)

    results = [prompt([1, 2, 3]), prompt([1, 2, 9], gap=0.25)]
    bf16 = summarize(results, torch.bfloat16)
    assert (bf16["lossless"], bf16["lossless_prompts"], bf16["near_tie_prompts"], bf16["passed"]) == (False, 1, 1, True)
    assert summarize(results, torch.float32)["passed"] is False
    assert summarize([*results, prompt([1, 7, 7], gap=2.0)], torch.bfloat16)["passed"] is False


def test_context_noise_is_drawn_where_the_features_are_from_one_draw_of_the_run_generator():
    features = torch.randn(50, 8, dtype=torch.bfloat16)
    first, again = (add_context_noise(features, 0.5, torch.Generator().manual_seed(3)) for _ in range(2))
    assert torch.equal(first, again) and first.dtype == features.dtype and first.device == features.device
    assert (first.float() - features.float()).abs().max() <= 0.5 + 0.01  # within the scale (bf16 rounding)
    # the run's CPU generator moves by one draw, whatever the feature size (no 315 MB draw on it)
    for size in (10, 10_000):
        used = torch.Generator().manual_seed(3)
        add_context_noise(torch.zeros(size, 8), 0.5, used)
        expected = torch.Generator().manual_seed(3)
        torch.randint(0, 2**63 - 1, (), generator=expected)
        assert torch.equal(used.get_state(), expected.get_state())


def test_float16_training_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="config train.dtype: float16 is refused: .*loss scaler"):
        load_config(None, ["train.dtype=fp16"], store="s", target="t", out="o")
    assert load_config(None, ["train.dtype=fp32"], store="s", target="t", out="o").train.dtype == "float32"
