"""`python -m train serve-check`'s handler (its parser: train/cli/serve_check.py). Imported only
when the command runs, so it imports at the top."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from store_schema.runtime.cli import fail
from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.target_model import load_target_model
from train.cli.speculate import decoding_request
from train.decoding.loading import DecodingRequest, by_thinking, load_decoding, mean_or_none, open_prompt_source
from train.decoding.speculate import decode_prompt
from train.export.drafter_dir import read_drafter_config, resolve_drafter_dir
from train.families.kinds import family_of
from train.sampling import Sampling
from train.serving import serve_check, vllm_memory


@dataclass(frozen=True)
class ServeCheckRequest:
    """What `serve-check` was asked: the decoding it shares with `speculate`, and its own
    flags (train/cli/serve_check.py says what each means), read once at the handler's top."""

    decoding: DecodingRequest
    max_new_tokens: int
    seed: int
    gpu_memory_utilization: float | None
    vllm_python: str | None
    workdir: Path

    @classmethod
    def from_args(cls, args) -> "ServeCheckRequest":
        workdir = Path(args.workdir) if args.workdir else Path(args.drafter) / serve_check.WORKDIR_NAME
        return cls(
            decoding=decoding_request(args),
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            gpu_memory_utilization=args.gpu_memory_utilization,
            vllm_python=args.vllm_python,
            workdir=workdir,
        )


def run(args) -> int:
    asked = ServeCheckRequest.from_args(args)
    read_target_config(asked.decoding.target)  # missing paths are usage errors before vLLM is looked for
    config = read_drafter_config(resolve_drafter_dir(asked.decoding.drafter))
    served_as = family_of(config).served(config)
    open_prompt_source(asked.decoding)
    try:
        sampling = Sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as error:
        return fail(str(error))
    unserved = serve_check.unserved_here(served_as)
    python, version = _vllm(serve_check, asked.vllm_python, unserved)
    loaded = load_decoding(asked.decoding, "serve-check")
    drafter_dir, stops, dtype = loaded.drafter_dir, loaded.stops, loaded.dtype
    request, share = vllm_request(asked, loaded, config, served_as, python, sampling)
    results = speculated(loaded, asked.max_new_tokens, served_as.round_tokens, sampling, asked.seed)
    freed = release(loaded)  # two copies of a 27B target never fit one card: vLLM starts after
    served = serve(python, request, asked.workdir) if python else {"skipped": unserved}
    outcomes = judged(asked.decoding.target, results, served, loaded, sampling) if "prompts" in served else None
    summary = _summary(serve_check, results, served, served_as.round_tokens, loaded, asked.decoding.thinking, outcomes)
    summary.update(
        drafter=str(drafter_dir),
        target=str(asked.decoding.target),
        target_freed_before_vllm=freed() is None,
        vllm_python=python,
        vllm_version=served.get("vllm_version", version),
        vllm_device=served.get("device"),
        vllm_log=str(asked.workdir / "vllm.log") if python else None,
        vllm_memory_share=asked.gpu_memory_utilization or share,
        dtype=str(dtype).removeprefix("torch."),
        block_size=served_as.round_tokens,
        max_new_tokens=asked.max_new_tokens,
        seed=None if sampling.greedy else asked.seed,
        stop_token_ids=stops,
        **loaded.other_target,
    )
    if summary.get("served_skipped"):
        print(f"note: {summary['served_skipped']}; only speculate vs the target was checked", file=sys.stderr)
    print(json.dumps(summary) if args.json else render(summary))
    found = serve_check.problems(summary)
    return fail("; ".join(found)) if found else 0


def vllm_request(
    asked: ServeCheckRequest, loaded, config, served_as, python: str | None, sampling: Sampling
) -> tuple[dict, float | None]:
    """What vLLM decodes (`serve_check.served_request`), and the CPU memory share sized for it."""
    token_prompts = [p.input_ids.tolist() for p in loaded.prompts]
    target, share = asked.decoding.target, None
    if asked.gpu_memory_utilization is None and loaded.device.type == "cpu" and python:
        share = _cpu_share(
            target, loaded.drafter_dir, config, served_as, token_prompts, asked.max_new_tokens, loaded.dtype
        )
    request = serve_check.served_request(
        Path(target).resolve(),
        loaded.drafter_dir.resolve(),
        token_prompts,
        served=served_as,
        max_new_tokens=asked.max_new_tokens,
        stop_token_ids=loaded.stops,
        dtype=str(loaded.dtype).removeprefix("torch."),
        gpu_memory_utilization=asked.gpu_memory_utilization,
        cpu_memory_share=share,
        sampling=sampling,
        seed=asked.seed,
    )
    return request, share


def judged(target, results: list, served: dict, loaded, sampling: Sampling) -> list:
    """vLLM's outputs judged by `speculate`'s rule (`serve_check.served_outcomes`); the
    target is loaded again, vLLM gone, only where that needs a forward."""
    outcomes = serve_check.served_outcomes(results, served["prompts"], loaded.stops, sampling)
    if serve_check.needs_the_target(outcomes):
        print("serve-check: loading the target again to judge vLLM's outputs", file=sys.stderr, flush=True)
        model = load_target_model(target, loaded.device, loaded.dtype).model
        serve_check.check_served_outcomes(model, loaded.prompts, outcomes)
    return outcomes


def release(loaded) -> weakref.ref:
    """Drop the target and the drafter (and their device memory) before vLLM starts; a
    weak reference to the target says whether anything still holds it."""
    freed = weakref.ref(loaded.model)
    loaded.model = loaded.drafter = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if freed() is not None:
        raise RuntimeError("serve-check: the target is still referenced; vLLM would load a second copy beside it")
    return freed


def serve(python: str, request: dict, workdir: Path) -> dict:
    """vLLM's decoding of the request, its process ended however this returns."""
    served_run = serve_check.start_served(python, request, workdir)
    print("waiting for vLLM ...", file=sys.stderr, flush=True)
    try:
        return served_run.result()
    finally:
        if served_run.process.poll() is None:
            served_run.process.terminate()
            served_run.process.wait()


def speculated(loaded, max_new_tokens: int, block_size: int, sampling: Sampling, seed: int) -> list:
    """`speculate` on every prompt (prompt i at seed + i), decoded in whole blocks up to
    the limit and cut there as vLLM cuts (`serve_check.cut_at_limit`), a line each."""
    results = []
    past_limit = max_new_tokens + block_size - 1
    for number, prompt in enumerate(loaded.prompts):
        ids = prompt.input_ids.to(loaded.device)
        decoded = decode_prompt(
            loaded.model, loaded.drafter, prompt.id, ids, past_limit, loaded.stops, sampling, seed + number
        )
        result = serve_check.cut_at_limit(decoded, max_new_tokens)
        results.append(result)
        print(
            f"[{number + 1}/{len(loaded.prompts)}] {prompt.id}: speculate tau {result.tau or 0:.3f}, "
            f"{'lossless' if result.lossless else 'MISMATCH'}",
            file=sys.stderr,
        )
    return results


def _vllm(serve_check, vllm_python: str | None, unserved: str | None) -> tuple[str | None, str | None]:
    """The python that runs vLLM and its version, said in one line; (None, None) when
    vLLM cannot serve the drafter here (`unserved` says why, in that line)."""
    if unserved:
        print(f"note: {unserved}; checking speculate against the target only (no vLLM needed)", file=sys.stderr)
        return None, None
    python = serve_check.find_vllm_python(vllm_python)
    version = serve_check.probe(python)
    print(f"vLLM {version} from {python}", file=sys.stderr)
    return python, version


def _cpu_share(target, drafter_dir, config, served_as, prompts, max_new_tokens: int, dtype) -> float:
    """vLLM's CPU memory share for these prompts (`vllm_memory`), said in one line."""
    needed = vllm_memory.served_engine_bytes(
        target,
        drafter_dir,
        config,
        serve_check.max_model_len(prompts, max_new_tokens, served_as.round_tokens),
        dtype.itemsize,
    )
    memory = vllm_memory.host_memory()
    share = vllm_memory.cpu_memory_share(needed, memory)
    print(
        f"vLLM's memory share {share:.2f} of {memory.total / vllm_memory.GIB:.1f} GiB host memory (its engine needs "
        f"~{needed / vllm_memory.GIB:.2f} GiB; {memory.available / vllm_memory.GIB:.1f} GiB available)",
        file=sys.stderr,
    )
    return share


def _summary(serve_check, results, served: dict, block_size: int, loaded, thinking, outcomes) -> dict:
    prompts = loaded.prompts
    rendered = {"thinking": thinking or "template default", "speculate_by_thinking": by_thinking(prompts, results)}
    if "skipped" in served:
        return {
            "prompts": len(results),
            "speculate_lossless": all(r.lossless for r in results),
            "served_skipped": served["skipped"],
            "speculate_tau": mean_or_none([r.tau for r in results if r.tau is not None]),
            **rendered,
        }
    compared = serve_check.compare(results, served["prompts"], loaded.stops, block_size, outcomes, loaded.dtype)
    return {**compared, **rendered}


def render(summary: dict) -> str:
    """Per-prompt lines, the per-position counts side by side, the overall figures."""
    if summary.get("served_skipped"):
        return (
            f"served: skipped ({summary['served_skipped']})\n"
            f"speculate: lossless {summary['speculate_lossless']}, tau {summary['speculate_tau']}"
        )
    lines = [f"{'prompt':<24}{'lossless':>9}{'served rounds':>14}{'speculate rounds':>17}{'same rounds':>12}"]
    for row in summary["per_prompt"]:
        lines.append(
            f"{row['id'][:23]:<24}{str(row['lossless']):>9}{row['served_rounds']:>14}"
            f"{row['speculate_rounds']:>17}{str(row['rounds_equal']):>12}"
        )
    counts = summary["per_position_accepted"]
    lines += ["", "accepted per draft position (rounds counted alike): served / speculate"]
    lines.append(
        "  "
        + ", ".join(
            f"{p}: {a}/{b}" for p, (a, b) in enumerate(zip(counts["served"], counts["speculate"]), start=1) if a or b
        )
    )
    lines += [
        "",
        f"vLLM {summary['vllm_version']} ({summary['vllm_device']}): lossless {summary['lossless_prompts']}/"
        f"{summary['prompts']}, served_tau {summary['served_tau']} ({summary['served_accepted']} accepted / "
        f"{summary['served_drafts']} drafts)",
        f"tokens per round: served {summary['served_tokens_per_round']}, speculate "
        f"{summary['speculate_tokens_per_round']} (relative difference {summary['tokens_per_round_difference']}); "
        f"speculate_tau {summary['speculate_tau']}",
    ]
    return "\n".join(lines)
