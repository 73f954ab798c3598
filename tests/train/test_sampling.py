"""Speculative decoding at temperature (train/sampling.py) is lossless in
distribution, with z-lab's semantics:

- the processed distribution (temperature, top-k, top-p) equals the reference's;
- the distribution check: decoded tokens, over many seeds, are distributed as the
  target's own sampling. Each token is mapped through the target's conditional CDF
  with a uniform jitter (the randomised probability integral transform: values exactly
  uniform and independent when the tokens follow the target's conditionals), binned
  into 10 equal bins, and a chi-square test against uniform must give p >= 1e-3. It
  passes for DFlash and DFlash 2 on the dense and the hybrid fixture targets, at the
  published card's settings (few drafts accepted: the residual path) and at a high
  temperature (most accepted: the acceptance and bonus paths), and it fails for a
  sampler biased on purpose (a test of the test);
- tau at temperature 1 agrees with `dflash_generate`'s within their 95 % intervals.
"""

from __future__ import annotations

import json

import builders
import pytest
import torch
from random_drafters import dflash_drafter
from reference_oracle import load_model, reference_decode

from train.decoding import speculate as speculate_module
from train.decoding.speculate import decode_prompt, interval95, speculative_generate, summarize
from train.export.drafter_dir import export_drafter, load_drafter
from train.sampling import Draft, Sampling, rejection_sample, sample

pytestmark = pytest.mark.usefixtures("one_thread")
CARD = Sampling(temperature=1.0, top_p=0.95, top_k=20)  # the published Qwen3.8-27B DFlash 2 card
HOT = Sampling(temperature=8.0)  # the tiny targets' distributions near uniform: most drafts accepted
P_VALUE_FLOOR = 1e-3
BINS = 10
NEW_TOKENS = 6
SEEDS = 80


def chi_square_p_value(values: torch.Tensor, bins: int = BINS) -> float:
    """p-value of a chi-square test of `values` in [0, 1) against the uniform law."""
    counts = torch.bincount((values * bins).long().clamp(max=bins - 1), minlength=bins).double()
    expected = values.numel() / bins
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64), statistic / 2))


@torch.no_grad()
def transformed(model, prompt: torch.Tensor, tokens: list[int], sampling: Sampling, jitter) -> torch.Tensor:
    """The randomised PIT of each new token under the target's processed conditionals."""
    ids = torch.tensor(tokens)
    logits = model(input_ids=torch.cat([prompt, ids[:-1]])[None]).logits[0, prompt.shape[0] - 1 :]
    probs = sampling.probs(logits).double()
    below = probs.cumsum(-1).gather(-1, ids[:, None])[:, 0] - probs.gather(-1, ids[:, None])[:, 0]
    at = probs.gather(-1, ids[:, None])[:, 0]
    return below + torch.rand(len(tokens), generator=jitter, dtype=torch.float64) * at


def distribution_p_value(model, drafter, prompt, sampling: Sampling) -> float:
    jitter = torch.Generator().manual_seed(12345)
    values = []
    for seed in range(SEEDS):
        decoded = speculative_generate(model, drafter, prompt, NEW_TOKENS, [], sampling, seed)
        values.append(transformed(model, prompt, decoded.tokens, sampling, jitter))
    return chi_square_p_value(torch.cat(values))


def drafter_of(kind: str, target_dir, mask_id):
    if kind == "dflash":
        return dflash_drafter(target_dir, mask_token_id=mask_id)
    # 256 candidates of 512: the draft distribution covers part of the vocabulary only
    return builders.warm_started(dflash_drafter(target_dir, mask_token_id=mask_id), selector_top_k=256).eval()


# -- the pieces ----------------------------------------------------------------------------
@pytest.mark.parametrize("settings", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 0.95, 20), (2.0, 1.0, 5), (1.0, 0.5, 3)])
def test_the_processed_distribution_is_the_references(settings):
    from dflash.model import _sampling_probs  # the reference's, private: compared here only

    logits = torch.randn(3, 7, 512, generator=torch.Generator().manual_seed(0)) * 3
    ours = Sampling(*settings).probs(logits)
    assert torch.allclose(ours, _sampling_probs(logits, *settings), atol=1e-7)
    assert torch.allclose(ours.sum(-1), torch.ones(3, 7))


def test_settings_are_checked_with_their_flag_names():
    for bad, flag in (((-1.0, 1.0, 0), "--temperature"), ((1.0, 0.0, 0), "--top-p"), ((1.0, 1.0, -2), "--top-k")):
        with pytest.raises(ValueError, match=flag):
            Sampling(*bad)


def committed_first_token(p: torch.Tensor, q: torch.Tensor, trials: int, rule) -> torch.Tensor:
    """The first committed token of `trials` one-slot blocks drafted from `q`, verified
    against `p` (rows: after the anchor, after the drafted token) by `rule`."""
    generator = torch.Generator().manual_seed(0)
    out = torch.empty(trials, dtype=torch.long)
    for trial in range(trials):
        draft = Draft(sample(q, generator), q)
        accepted, bonus = rule(draft, p, generator)
        out[trial] = draft.tokens[0] if accepted else bonus
    return out


def biased_rejection(draft, target_probs, generator):
    """Biased on purpose: a rejected draft resamples from p, not from max(0, p - q)."""
    accepted, token = rejection_sample(draft, target_probs, generator)
    if accepted < draft.tokens.shape[0]:
        token = int(sample(target_probs[accepted], generator))
    return accepted, token


def test_a_greedy_draft_has_no_distribution_to_verify_against():
    draft = Draft(torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="greedy draft carries no distribution"):
        draft.draft_probability()


def test_the_rejection_rule_commits_the_targets_distribution_and_a_biased_one_is_caught():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    for rule, passes in ((rejection_sample, True), (biased_rejection, False)):
        tokens = committed_first_token(p, q, 4000, rule)
        counts = torch.bincount(tokens, minlength=4).double()
        statistic = ((counts[:3] - 4000 * p[0, :3]) ** 2 / (4000 * p[0, :3])).sum()
        p_value = float(torch.special.gammaincc(torch.tensor(1.0, dtype=torch.float64), statistic / 2))
        assert counts[3] == 0  # never a token the target cannot sample
        assert (p_value >= P_VALUE_FLOOR) == passes, (rule.__name__, p_value, counts)


# -- the distribution check on the fixture targets -----------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("target", ["qwen3_dir", "qwen3_5_dir"])
@pytest.mark.parametrize("sampling", [CARD, HOT], ids=["card", "hot"])
def test_speculative_sampling_is_distributed_as_the_target_alone(kind, target, sampling, request, tokenizer, mask_id):
    target_dir = request.getfixturevalue(target)
    model, drafter = load_model(target_dir), drafter_of(kind, target_dir, mask_id)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    p_value = distribution_p_value(model, drafter, prompt, sampling)
    assert p_value >= P_VALUE_FLOOR, p_value
    result = decode_prompt(model, drafter, "p", prompt, 16, [], sampling, seed=3)
    assert result.lossless and result.outside_support is None  # the per-prompt support check
    if sampling is HOT:  # drafts accepted: the path through acceptance and the bonus was taken
        assert max(result.speculative.acceptance_lengths) >= 3


def test_the_distribution_check_fails_on_a_biased_sampler(qwen3_dir, tokenizer, mask_id, monkeypatch):
    """Accepting every draft commits the drafter's distribution, not the target's."""
    model, drafter = load_model(qwen3_dir), drafter_of("dflash", qwen3_dir, mask_id)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    monkeypatch.setattr(
        speculate_module,
        "rejection_sample",
        lambda draft, probs, generator: (draft.tokens.shape[0], int(sample(probs[-1], generator))),
    )
    assert distribution_p_value(model, drafter, prompt, CARD) < P_VALUE_FLOOR
    result = decode_prompt(model, drafter, "p", prompt, 16, [], CARD, seed=3)
    assert not result.lossless and result.outside_support is not None and result.mismatch_logit_gap > 0


def test_a_seed_decodes_the_same_tokens_again(qwen3_5_dir, tokenizer, mask_id):
    model, drafter = load_model(qwen3_5_dir), drafter_of("dflash2", qwen3_5_dir, mask_id)
    prompt = builders.chat_prompts(tokenizer, 1)[0]
    runs = [speculative_generate(model, drafter, prompt, 24, [], CARD, seed).tokens for seed in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


# -- parity with the reference -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_tau_at_temperature_1_agrees_with_dflash_generate(kind, qwen3_dir, tokenizer, mask_id, tmp_path):
    """Per-run tau of both decoders over the same prompts and 12 seeds each, at T = 1
    (the reference's defaults otherwise): their 95 % intervals overlap."""
    export_drafter(drafter_of(kind, qwen3_dir, mask_id), tmp_path / "drafter", dtype=torch.float32)
    model, drafter = load_model(qwen3_dir), load_drafter(tmp_path / "drafter").eval()
    warm = Sampling(temperature=1.0)
    ours, theirs, same_tokens = [], [], []
    for prompt in builders.chat_prompts(tokenizer, 2):
        for seed in range(12):
            decoded = speculative_generate(model, drafter, prompt, 24, [], warm, seed)
            ours.append(sum(decoded.acceptance_lengths) / len(decoded.acceptance_lengths))
            torch.manual_seed(seed)
            reference = reference_sampled(tmp_path / "drafter", model, prompt, 24, warm)
            theirs.append(sum(reference.acceptance_lengths) / len(reference.acceptance_lengths))
            same_tokens.append(decoded.tokens == reference.output_ids[0, prompt.shape[0] :].tolist())
    ours_interval, theirs_interval = interval95(ours), interval95(theirs)
    print(f"{kind}: speculate tau 95 % {ours_interval}, dflash_generate {theirs_interval}")
    assert ours_interval[0] <= theirs_interval[1] and theirs_interval[0] <= ours_interval[1]
    assert ours_interval[0] > 1.5  # drafts do get accepted at T = 1 on these near-uniform targets
    if kind == "dflash":  # the same draws in the same order: the same seed decodes the same tokens
        assert all(same_tokens)


def reference_sampled(export_dir, model, prompt, max_new_tokens, sampling: Sampling):
    """`dflash_generate` at temperature on the same export and target."""
    settings = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    return reference_decode(export_dir, model, prompt, max_new_tokens, **settings)


def test_the_summary_at_temperature_names_its_settings_and_baseline(qwen3_dir, tokenizer, mask_id):
    model, drafter = load_model(qwen3_dir), drafter_of("dflash", qwen3_dir, mask_id)
    results = [
        decode_prompt(model, drafter, str(i), prompt, 12, [], CARD, seed=i)
        for i, prompt in enumerate(builders.chat_prompts(tokenizer, 3))
    ]
    summary = summarize(results)
    assert summary["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    assert "target_sampled" in summary and "greedy" not in summary
    assert summary["passed"] and summary["exactness_rule"].startswith("in distribution")
    low, high = summary["tau_ci95"]
    assert low <= summary["tau"] <= high


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_cli_decodes_at_the_published_cards_settings(kind, qwen3_dir, tokenizer, mask_id, tmp_path, capsys):
    from train.cli import main

    export = export_drafter(drafter_of(kind, qwen3_dir, mask_id), tmp_path / "drafter", dtype=torch.float32)
    prompts = builders.write_chat_jsonl(tmp_path / "p.jsonl", builders.coding_chats(2))
    base = ["speculate", "--drafter", str(export), "--target", str(qwen3_dir), "--prompts", str(prompts)]
    card = ["--temperature", "1", "--top-p", "0.95", "--top-k", "20", "--seed", "0", "--max-new-tokens", "8"]
    assert main([*base, *card, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 20} and summary["seed"] == 0
    assert summary["passed"] and summary["prompts"] == 2 and summary["target_sampled"]["new_tokens"] > 0
    assert main([*base, *card]) == 0
    table = capsys.readouterr().out
    assert "temperature 1.0, top-p 0.95, top-k 20, seed 0" in table and "target alone:" in table
    assert main([*base, "--temperature", "-1"]) == 1
    assert "--temperature must be >= 0" in capsys.readouterr().err
