"""Speculative decoding, beside the target's own decoding.

A round, with the anchor at position `start` (the bonus token of the previous
round, which the target has not processed yet):

1. the drafter's family drafts b-1 tokens after the anchor from the target's features
   of the verified positions `< start` (its `DraftSession`; DFlash:
   `train.families.dflash.decoding`, one block `[anchor, MASK x (b-1)]`), greedy along
   the path the drafter decodes or sampled at temperature;
2. the target verifies the whole block in one forward;
3. greedy: the drafted tokens that equal the target's own greedy choices are
   accepted, up to the first mismatch, plus the target's token after them (the
   bonus, the next anchor); at temperature: rejection sampling
   (train/sampling.py). accepted + 1 tokens, cut at a stop token or the
   token limit;
4. the target's cache keeps the anchor and the accepted tokens
   (`train.decoding.target_decode.TargetSession.keep`: cropped; before transformers
   5.25 linear-attention layers are restored and re-run), and the drafter's context
   grows by their features.

b is the most tokens a round verifies (DFlash: the block size), or what is left of `max_new_tokens` on the last
round (as z-lab's `dflash_generate` does). Greedy: every committed token is the
target's greedy choice after the tokens before it, so the output equals greedy
decoding token for token (`lossless`), up to floating-point differences between a
block forward and a one-token forward, which `decode_prompt` measures rather than
assumes. At temperature the output is distributed as the target's own sampling
(lossless in distribution: tests/train/test_sampling.py checks it). Acceptance length
per round = tokens the round committed, exactly as `dflash_generate` records it;
`tau` is their mean per prompt, then over prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from train.decoding.target_decode import TargetSession, clock
from train.decoding.tree_decode import grow_tree, verify_tree
from train.families.family import DraftSession
from train.families.kinds import family_of
from train.sampling import GREEDY, Draft, Sampling, rejection_sample, sample


@dataclass
class Decoded:
    """One decoding of one prompt: the new tokens and what it cost."""

    tokens: list[int]
    target_forwards: int
    wall_s: float
    acceptance_lengths: list[int] = field(default_factory=list)  # speculative only: one per round
    rerun_forwards: int = 0  # of target_forwards: re-runs after a partial acceptance (linear attention)
    target_tokens: int = 0  # tokens the target ran, the prompt's included

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else math.nan

    def timing(self) -> dict:
        out = {
            "target_forwards": self.target_forwards,
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }
        if self.acceptance_lengths or self.rerun_forwards:
            out["rerun_forwards"] = self.rerun_forwards
            out["target_tokens"] = self.target_tokens
        return out


def next_token(logits: torch.Tensor, sampling: Sampling, generator) -> int:
    """The target's token after `logits` [V]: its argmax, or a draw at temperature."""
    return int(logits.argmax()) if sampling.greedy else int(sample(sampling.probs(logits), generator))


def seeded(sampling: Sampling, seed: int, device) -> torch.Generator | None:
    """The random source of one decoding (None for greedy decoding)."""
    return None if sampling.greedy else torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def greedy_generate(
    model, prompt: torch.Tensor, max_new_tokens: int, stop_ids, sampling: Sampling = GREEDY, seed: int = 0
) -> Decoded:
    """The target's own decoding, one token per forward, plain cache: greedy, or
    sampled at `sampling`'s settings (target-alone sampling, speculation's baseline)."""
    stop = set(stop_ids)
    session = TargetSession(model)
    generator = seeded(sampling, seed, session.device)
    started = clock(session.device)
    tokens: list[int] = []
    ids = prompt
    while True:
        logits, _ = session.forward(ids, last_only=True)
        token = next_token(logits[-1], sampling, generator)
        tokens.append(token)
        if len(tokens) >= max_new_tokens or token in stop:
            break
        ids = prompt.new_tensor([token])
    return Decoded(tokens, session.forwards, clock(session.device) - started)


def verify(block: torch.Tensor, draft: Draft | None, logits: torch.Tensor, sampling: Sampling, generator):
    """(drafted tokens accepted, the target's token after them) from the target's
    `logits` [size, V] over `block` [anchor, drafted...]: the longest prefix equal to the
    target's argmax, or rejection sampling at temperature (train.sampling)."""
    if sampling.greedy:
        choice = logits.argmax(dim=-1)
        accepted = int((block[1:] == choice[:-1]).long().cumprod(0).sum())
        return accepted, int(choice[accepted])
    probs = sampling.probs(logits)
    if draft is None:  # a one-token block: nothing drafted
        return 0, int(sample(probs[0], generator))
    return rejection_sample(draft, probs, generator)


def chain_round(target, session: DraftSession, anchor: int, size: int, sampling: Sampling, generator):
    """One round along a chain: `size - 1` tokens drafted after the anchor and verified with
    it in one forward. -> (the block [anchor, drafted...], accepted tokens + the bonus,
    the block's features [size, F])."""
    block = torch.tensor([anchor], device=target.device)
    drafted = session.draft(anchor, size, sampling, generator) if size > 1 else None
    if drafted is not None:
        block = torch.cat([block, drafted.tokens.to(block)])
    target.save()
    logits, features = target.forward(block, features=True)
    accepted, bonus = verify(block, drafted, logits, sampling, generator)
    return block, block[1 : accepted + 1].tolist() + [bonus], features


@torch.no_grad()
def speculative_generate(
    model,
    drafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    tree_budget: int = 0,
    rollback: str = "auto",
) -> Decoded:
    """Speculative decoding of `prompt` [n] with the target `model` (whose embedding and
    lm_head the drafter uses) and `drafter` (of any family: its `draft_session` drafts),
    greedy or at `sampling`'s settings (seeded by `seed`), along a chain or, with
    `tree_budget` nodes, a DDTree tree (train/decoding/tree_decode.py); a hybrid target's
    linear-attention layers rolled back the `rollback` way (`target_decode.ROLLBACKS`)."""
    if tree_budget and not sampling.greedy:
        raise ValueError("--tree decodes greedily: it takes no --temperature")
    stop = set(stop_ids)
    session = family_of(drafter).draft_session(drafter, model.get_input_embeddings(), model.get_output_embeddings())
    target = TargetSession(model, drafter.config.context_layer_ids, session.round_tokens, rollback)
    generator = seeded(sampling, seed, target.device)
    started = clock(target.device)

    logits, features = target.forward(prompt, features=True, last_only=True)
    session.extend(features, prompt)
    tokens = [next_token(logits[-1], sampling, generator)]
    lengths: list[int] = []
    start = prompt.shape[0]  # position of the anchor: tokens[-1]
    limit = start + max_new_tokens  # positions the output may reach (exclusive)
    stopped = tokens[-1] in stop
    while start + 1 < limit and not stopped:
        size, anchor = min(session.round_tokens, limit - start), tokens[-1]
        verified = None  # a tree's path: the cache keeps the anchor and the accepted path already
        if tree_budget and size > 1:
            new, features = verify_tree(
                target, grow_tree(session.position_logits(anchor, size), anchor, tree_budget), start
            )
        else:
            verified, new, features = chain_round(target, session, anchor, size, sampling, generator)
        produced = min(len(new), limit - start - 1)
        for i, token in enumerate(new[:produced]):
            if token in stop:
                produced, stopped = i + 1, True
                break
        tokens += new[:produced]
        lengths.append(produced)
        if start + produced + 1 < limit and not stopped:  # the cache is needed again
            if verified is not None:
                target.keep(start, verified, produced)
            session.extend(features[:produced], prompt.new_tensor([anchor, *new[: produced - 1]]))
        start += produced
    return Decoded(tokens, target.forwards, clock(target.device) - started, lengths, target.reruns, target.tokens)


@dataclass
class PromptResult:
    """Speculative decoding of one prompt beside the target's own decoding of it.

    Greedy: both outputs must be equal token for token (`lossless`). At temperature the
    outputs differ by design; a prompt's check is that every committed token lies inside
    the target's sampling support after the tokens before it (`outside_support`: the
    first that does not), and the distribution itself is the suite's check
    (train/sampling.py)."""

    prompt_id: str
    prompt_tokens: int
    speculative: Decoded
    greedy: Decoded  # the target alone, at the same settings: greedy, or sampled
    mismatch_logit_gap: float | None = None  # see `mismatch_logit_gap`
    sampling: Sampling = GREEDY
    outside_support: int | None = None  # at temperature: see `first_outside_support`

    @property
    def lossless(self) -> bool:
        if not self.sampling.greedy:
            return self.outside_support is None
        return self.speculative.tokens == self.greedy.tokens

    @property
    def tau(self) -> float | None:
        lengths = self.speculative.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else None

    def first_mismatch(self) -> int | None:
        if not self.sampling.greedy:
            return self.outside_support
        pairs = zip(self.speculative.tokens, self.greedy.tokens)
        index = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if index is None and len(self.speculative.tokens) != len(self.greedy.tokens):
            index = min(len(self.speculative.tokens), len(self.greedy.tokens))
        return index

    def to_dict(self) -> dict:
        return {
            "id": self.prompt_id,
            "prompt_tokens": self.prompt_tokens,
            "lossless": self.lossless,
            "first_mismatch": self.first_mismatch(),
            "mismatch_logit_gap": self.mismatch_logit_gap,
            "tau": None if self.tau is None else round(self.tau, 4),
            "rounds": len(self.speculative.acceptance_lengths),
            "new_tokens": len(self.speculative.tokens),
            "acceptance_lengths": self.speculative.acceptance_lengths,
            "speculative": self.speculative.timing(),
            baseline_name(self.sampling): {**self.greedy.timing(), "new_tokens": len(self.greedy.tokens)},
        }


def baseline_name(sampling: Sampling) -> str:
    """The JSON key of the target-alone decoding: "greedy", or "target_sampled"."""
    return "greedy" if sampling.greedy else "target_sampled"


def decode_prompt(
    model,
    drafter,
    prompt_id: str,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    tree_budget: int = 0,
    rollback: str = "auto",
) -> PromptResult:
    """The target alone, then speculative decoding of one prompt (along a chain, or a
    DDTree tree of `tree_budget` nodes), at the same settings and seed; greedy: a
    mismatch's logit gap; at temperature: the support check."""
    alone = greedy_generate(model, prompt, max_new_tokens, stop_ids, sampling, seed)
    speculative = speculative_generate(
        model, drafter, prompt, max_new_tokens, stop_ids, sampling, seed, tree_budget, rollback
    )
    result = PromptResult(prompt_id, int(prompt.shape[0]), speculative, alone, sampling=sampling)
    if not sampling.greedy:
        result.outside_support, result.mismatch_logit_gap = first_outside_support(model, prompt, result)
    elif not result.lossless:
        result.mismatch_logit_gap = mismatch_logit_gap(model, prompt, result)
    return result


@torch.no_grad()
def first_outside_support(model, prompt: torch.Tensor, result: PromptResult) -> tuple[int | None, float | None]:
    """(index, logit gap) of the first speculative token outside the target's sampling
    support given the tokens before it (one cache-free forward), or (None, None). The
    gap is the least kept token's logit minus that token's: near 0 is a near-tie at the
    support's edge, as `mismatch_logit_gap` is one at the argmax."""
    tokens = torch.tensor(result.speculative.tokens, device=prompt.device)
    sequence = torch.cat([prompt, tokens[:-1]])
    logits = model(input_ids=sequence[None], use_cache=False).logits[0, prompt.shape[0] - 1 :].float()
    probs = result.sampling.probs(logits)
    outside = (probs.gather(-1, tokens[:, None])[:, 0] <= 0).nonzero()
    if outside.numel() == 0:
        return None, None
    index = int(outside[0, 0])
    kept = logits[index][probs[index] > 0]
    return index, round(float(kept.min() - logits[index, tokens[index]]), 6)


@torch.no_grad()
def mismatch_logit_gap(model, prompt: torch.Tensor, result: PromptResult) -> float | None:
    """|logit(greedy's token) - logit(speculative's token)| at the first mismatch, from
    one cache-free forward over the prompt and the tokens both agree on. Near 0 is a
    near-tie that a block forward and a one-token forward round differently (expected
    now and then in bf16); a large gap means a decoding bug. None when one output
    merely ends earlier (a stop token one of them did not produce)."""
    index = result.first_mismatch()
    if index is None or index >= min(len(result.speculative.tokens), len(result.greedy.tokens)):
        return None
    prefix = torch.cat([prompt, prompt.new_tensor(result.greedy.tokens[:index])])
    logits = model(input_ids=prefix[None], use_cache=False, logits_to_keep=1).logits[0, -1].float()
    return round(abs(float(logits[result.greedy.tokens[index]] - logits[result.speculative.tokens[index]])), 6)


# The exactness rule of `speculate`. In fp32 every committed token must equal greedy
# decoding's. In bf16 / fp16 a block forward and a one-token forward of the same
# positions round differently (bf16 keeps 8 significant bits: one step is 0.125 at
# logits of 16-32), so two candidates within a few steps of each other can swap: a
# mismatch whose target logit gap (`mismatch_logit_gap`) is at most NEAR_TIE_LOGIT_GAP
# (4 such steps) is a near-tie, reported but not a failure; a larger gap, or outputs
# that differ without one, is a decoding bug.
NEAR_TIE_LOGIT_GAP = 0.5
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def mismatch_allowed(lossless: bool, gap: float | None, dtype: torch.dtype) -> bool:
    """Whether a prompt's outcome passes the rule above."""
    if lossless:
        return True
    return dtype in REDUCED_PRECISION and gap is not None and gap <= NEAR_TIE_LOGIT_GAP


def describe_rule(dtype: torch.dtype, sampling: Sampling = GREEDY) -> str:
    rule = "exact" if sampling.greedy else "in distribution (per prompt: every token inside the target's support)"
    if dtype in REDUCED_PRECISION:
        return (
            f"{rule}, or a near-tie (target logit gap <= {NEAR_TIE_LOGIT_GAP}) in {str(dtype).removeprefix('torch.')}"
        )
    return rule


def summarize(results: list[PromptResult], dtype: torch.dtype = torch.float32) -> dict:
    """Overall figures: tau averaged per prompt then over prompts (prompts whose
    first token already ended the answer have no round and no tau) with its 95 %
    interval over prompts; counts and times summed; tokens/s = all new tokens / all
    wall time. `passed`: every prompt lossless, or (bf16 / fp16) a near-tie
    (`mismatch_allowed`); at temperature, lossless is the support check (`PromptResult`)."""
    taus = [r.tau for r in results if r.tau is not None]
    allowed = [mismatch_allowed(r.lossless, r.mismatch_logit_gap, dtype) for r in results]
    sampling = results[0].sampling if results else GREEDY

    def total(kind: str) -> dict:
        runs = [getattr(r, kind) for r in results]
        tokens = sum(len(d.tokens) for d in runs)
        wall = sum(d.wall_s for d in runs)
        return {
            "target_forwards": sum(d.target_forwards for d in runs),
            "wall_s": round(wall, 4),
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
            "new_tokens": tokens,
        }

    speculative, alone = total("speculative"), total("greedy")
    speculative["rerun_forwards"] = sum(r.speculative.rerun_forwards for r in results)
    speculative["target_tokens"] = sum(r.speculative.target_tokens for r in results)
    rounds = sum(len(r.speculative.acceptance_lengths) for r in results)
    verified = speculative["target_tokens"] - sum(r.prompt_tokens for r in results)
    speculative["target_tokens_per_round"] = round(verified / rounds, 3) if rounds else None
    speedup = None
    if speculative["tokens_per_s"] and alone["tokens_per_s"]:
        speedup = round(speculative["tokens_per_s"] / alone["tokens_per_s"], 3)
    return {
        "prompts": len(results),
        "lossless": all(r.lossless for r in results),
        "lossless_prompts": sum(r.lossless for r in results),
        "near_tie_prompts": sum(ok and not r.lossless for ok, r in zip(allowed, results)),
        "passed": all(allowed),
        "exactness_rule": describe_rule(dtype, sampling),
        "sampling": sampling.to_dict(),
        "tau": round(sum(taus) / len(taus), 4) if taus else None,
        "tau_ci95": interval95(taus),
        "rounds": rounds,
        "new_tokens": speculative["new_tokens"],
        "speculative": speculative,
        baseline_name(sampling): alone,
        "speedup": speedup,
    }


def interval95(values: list[float]) -> list[float] | None:
    """The normal 95 % interval of the mean of `values` ([low, high]); None under 2 values."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    spread = 1.96 * math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
    return [round(mean - spread, 4), round(mean + spread, 4)]
