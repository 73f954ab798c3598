"""gpu_check's phases over the drafters its training phases trained (benchmarks/gpu_check.py
runs them in order): each exports a run and drives the product's own command in-process,
as a user would, and reads its `--json` line.

- speculate: `train speculate` on the store's samples for DFlash and, when its phase
  passed, DFlash 2 (the target and drafter decoding for real, bf16 on CUDA under the
  near-tie rule); lossless, tau and tokens/s per kind. DFlash decodes twice on the
  hybrid target, its linear attention rolled back each way (`--rollback`: auto, which
  is transformers' own where it has it, and rerun): the tokens/s of the two is the
  measurement that decides auto's choice.
- eval: `train eval`'s offline tau of the DFlash drafter on the same store.
- serve_check: `train serve-check` where vLLM imports; elsewhere "skipped", which keeps
  the verdict from PASS."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path


def command_json(argv: list[str]) -> tuple[int, dict]:
    """A `python -m train` command run in-process with `--json`: (exit code, its last line)."""
    from train.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([*argv, "--json"])
    lines = printed.getvalue().strip().splitlines()
    if not lines:
        raise RuntimeError(f"train {argv[0]} printed no result (exit {code})")
    return code, json.loads(lines[-1])


def exported(run: Path) -> Path:
    """The run's final checkpoint exported next to it (once)."""
    from train.cli import main

    drafter = run / "drafter"
    if not (drafter / "config.json").is_file():
        with contextlib.redirect_stdout(io.StringIO()):  # its JSON line is not a phase's
            code = main(["export", str(run), "--out", str(drafter)])
        if code != 0:
            raise RuntimeError(f"train export {run} failed")
    return drafter


def speculate(runs: dict[str, tuple[Path, list[str]] | str], model: Path, store: Path, size: dict) -> dict:
    """`runs`: a name -> (the run directory, more flags), or why it has none ("skipped: ...")."""
    check: dict = {}
    for kind, run in runs.items():
        if isinstance(run, str):
            check[kind] = run
            continue
        directory, flags = run
        code, summary = command_json(
            ["speculate", "--drafter", str(exported(directory)), "--target", str(model), "--store", str(store)]
            + ["--split", "all", "--limit", str(size["decode_prompts"]), "--max-new-tokens", str(size["decode_tokens"])]
            + flags
        )
        check[kind] = {
            "exit": code,
            "passed": summary["passed"],
            "lossless_prompts": summary["lossless_prompts"],
            "near_tie_prompts": summary["near_tie_prompts"],
            "prompts": summary["prompts"],
            "tau": summary["tau"],
            "dtype": summary["dtype"],
            "tokens_per_s": summary["speculative"]["tokens_per_s"],
            "speedup": summary.get("speedup"),
            "rollback": summary["rollback"],
            "rerun_forwards": summary["speculative"]["rerun_forwards"],
        }
    return {"speculate_check": check}


def offline_eval(run: Path, model: Path, store: Path, size: dict) -> dict:
    code, result = command_json(
        ["eval", "--store", str(store), "--drafter", str(exported(run)), "--target", str(model)]
        + ["--split", "all", "--max-samples", str(size["decode_prompts"])]
        + ["--max-blocks-per-sample", str(size["eval_blocks"])]
    )
    if code != 0:
        raise RuntimeError(f"train eval exited {code}")
    return {"eval_tau": result.get("tau"), "eval_samples": result.get("samples")}


def serve_check(run: Path, model: Path, store: Path, size: dict) -> dict:
    """vLLM serving the exported drafter against `speculate`; skipped where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return {"serve_check": "skipped: vLLM does not import here"}
    code, result = command_json(
        ["serve-check", "--drafter", str(exported(run)), "--target", str(model), "--store", str(store)]
        + ["--split", "all", "--limit", str(size["decode_prompts"]), "--max-new-tokens", str(size["decode_tokens"])]
    )
    return {"serve_check": {"exit": code, "passed": result.get("passed"), "tau": result.get("tau")}}


def decode_problems(figures: dict) -> list[str]:
    """Why the decode phases did not pass: a kind whose decoding broke the exactness rule."""
    found = []
    for kind, check in figures.get("speculate_check", {}).items():
        if isinstance(check, dict) and not check["passed"]:
            found.append(f"speculate {kind}: {check['prompts'] - check['lossless_prompts']} prompt(s) not lossless")
    serve = figures.get("serve_check")
    if isinstance(serve, dict) and not serve["passed"]:
        found.append("serve-check: vLLM's output differs from speculate's")
    return found
