"""`python -m train speculate`'s handler (its parser: train/cli/speculate.py). Imported only
when the command runs, so it imports at the top."""

from __future__ import annotations

import json
import sys

from store_schema.runtime.cli import fail
from train.cli.speculate import decoding_request
from train.decoding.loading import Decoding, by_set, by_thinking, load_decoding
from train.decoding.speculate import baseline_name, decode_prompt, summarize
from train.decoding.target_decode import resolve_rollback
from train.decoding.tree_decode import verification_method
from train.families.kinds import family_of
from train.sampling import Sampling


def run(args) -> int:
    try:
        sampling = Sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as error:
        return fail(str(error))
    if args.tree and not sampling.greedy:
        return fail("--tree decodes greedily (DDTree verifies the target's argmax): leave out --temperature")
    loaded = load_decoding(decoding_request(args), "speculate")
    results = decode_all(loaded, sampling, args.seed, args.max_new_tokens, args.tree or 0, args.rollback)
    prompts, drafter, device, dtype = loaded.prompts, loaded.drafter, loaded.device, loaded.dtype
    summary = summarize(results, dtype)
    summary.update(
        drafter=str(loaded.drafter_dir),
        target=str(args.target),
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        block_size=family_of(drafter).served(drafter.config).round_tokens,
        max_new_tokens=args.max_new_tokens,
        seed=None if sampling.greedy else args.seed,
        tree=tree_summary(loaded, args.tree),
        rollback=resolve_rollback(args.rollback),
        stop_token_ids=loaded.stops,
        thinking=args.thinking or "template default",
        by_thinking=by_thinking(prompts, results),
        **by_set(prompts, results),
        per_prompt=[r.to_dict() for r in results],
        **loaded.other_target,
    )
    print(json.dumps(summary) if args.json else render(summary))
    failed = summary["prompts"] - summary["lossless_prompts"] - summary["near_tie_prompts"]
    return (
        0
        if summary["passed"]
        else fail(f"speculative output fails the rule on {failed} prompt(s) (rule: {summary['exactness_rule']})")
    )


def tree_summary(loaded: Decoding, budget: int | None) -> dict | None:
    """What `--tree` decoded along: the budget, what the tree is built over, how it was verified."""
    if not budget:
        return None
    return {
        "budget": budget,
        "built_over": "each drafted slot's top tokens by the drafter's log-softmax (DFlash 2: its unary lists)",
        "verify": verification_method(loaded.model),
    }


def decode_all(
    loaded: Decoding, sampling: Sampling, seed: int, max_new_tokens: int, tree_budget: int = 0, rollback: str = "auto"
) -> list:
    """Every prompt decoded by the target alone and speculatively (prompt i at seed + i),
    a line each; one short untimed pass first, so one-time setup is not charged to the
    first prompt. `rollback`: how a hybrid target's linear attention is rolled back."""
    model, drafter, prompts, stops, device = loaded.model, loaded.drafter, loaded.prompts, loaded.stops, loaded.device
    settings = "greedy" if sampling.greedy else _settings(sampling, seed)
    if tree_budget:
        settings += f", along a DDTree tree of {tree_budget} nodes"
    print(
        f"speculate: {len(prompts)} prompt(s), up to {max_new_tokens} new tokens each, {settings}, "
        "the target alone then speculative",
        file=sys.stderr,
        flush=True,
    )
    first = prompts[0].input_ids.to(device)
    warmup = min(8, max_new_tokens)
    decode_prompt(model, drafter, "warmup", first, warmup, stops, sampling, seed, tree_budget, rollback)
    results = []
    for number, prompt in enumerate(prompts, start=1):
        ids = prompt.input_ids.to(device)
        result = decode_prompt(
            model, drafter, prompt.id, ids, max_new_tokens, stops, sampling, seed + number - 1, tree_budget, rollback
        )
        results.append(result)
        print(
            f"[{number}/{len(prompts)}] {prompt.id}: tau {_fmt(result.tau)}, {len(result.speculative.tokens)} tokens, "
            f"{_verdict(result)}",
            file=sys.stderr,
        )
    return results


def _verdict(result) -> str:
    if result.lossless:
        return "lossless" if result.sampling.greedy else "inside the target's support"
    what = "MISMATCH" if result.sampling.greedy else "OUTSIDE the target's sampling support"
    return f"{what} at new token {result.first_mismatch()} (target logit gap {result.mismatch_logit_gap})"


def _settings(sampling, seed) -> str:
    return f"temperature {sampling.temperature}, top-p {sampling.top_p}, top-k {sampling.top_k}, seed {seed}"


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(summary: dict) -> str:
    """Per-prompt lines, then the overall figures."""
    baseline = baseline_name(Sampling(**summary["sampling"]))
    lines = [f"{'prompt':<24}{'lossless':>9}{'tau':>8}{'rounds':>8}{'tokens':>8}{'spec tok/s':>12}{'alone tok/s':>14}"]
    for row in summary["per_prompt"]:
        lines.append(
            f"{row['id'][:23]:<24}{str(row['lossless']):>9}{_fmt(row['tau']):>8}{row['rounds']:>8}"
            f"{row['new_tokens']:>8}{_fmt(row['speculative']['tokens_per_s'], 1):>12}"
            f"{_fmt(row[baseline]['tokens_per_s'], 1):>14}"
        )
    sampling = summary["sampling"]
    greedy_decoding = sampling["temperature"] == 0
    spec, alone = summary["speculative"], summary[baseline_name(Sampling(**sampling))]
    interval = summary.get("tau_ci95")
    lines += [
        "",
        f"prompts {summary['prompts']}, lossless {summary['lossless_prompts']}/{summary['prompts']}"
        f"{f' (+{n} near-ties)' if (n := summary['near_tie_prompts']) else ''}, "
        f"tau {_fmt(summary['tau'])}{f' (95 % {interval[0]:.3f}-{interval[1]:.3f})' if interval else ''}, "
        f"rounds {summary['rounds']}, new tokens {summary['new_tokens']}, "
        f"{'greedy' if greedy_decoding else _settings(Sampling(**sampling), summary.get('seed'))}",
        *[
            f"thinking {setting}: lossless {row['lossless']}, tau {_fmt(row['tau'])} ({row['prompts']} prompts)"
            for setting, row in summary.get("by_thinking", {}).items()
        ],
        *[
            f"{what} {name}: lossless {row['lossless']}, tau {_fmt(row['tau'])} ({row['prompts']} prompts)"
            for what, key in (("set", "by_set"), ("category", "by_category"))
            for name, row in summary.get(key, {}).items()
        ],
        *([f"tree: {tree['budget']} nodes, verified by {tree['verify']}"] if (tree := summary.get("tree")) else []),
        f"speculative: {spec['target_forwards']} target forwards ({spec['rerun_forwards']} re-runs, "
        f"{_fmt(spec.get('target_tokens_per_round'), 2)} target tokens per round), "
        f"{spec['wall_s']:.2f} s, {_fmt(spec['tokens_per_s'], 1)} tokens/s",
        f"{'greedy:' if greedy_decoding else 'target alone:':<13}{alone['target_forwards']} target forwards, "
        f"{alone['wall_s']:.2f} s, {_fmt(alone['tokens_per_s'], 1)} tokens/s (speedup {_fmt(summary['speedup'], 2)}x)",
    ]
    return "\n".join(lines)
