"""Capture vLLM's drafter on its first draft round of one prompt: its inputs and its
draft logits, saved with safetensors, to compare with this project's drafter.

Run as a script by the vLLM environment's python (`python vllm_logits.py
REQUEST.json OUT.safetensors`); like vllm_runner.py (whose `build_llm` it uses) it
imports only the standard library, vLLM, torch and safetensors, never this project.
The request is vllm_runner's with one prompt in `prompts`; its `method` picks the
drafter class.

vLLM's drafter attention reads the running engine's KV cache and forward context, so
the drafter is not run alone: a real engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and the methods of its drafter class that the
proposer calls (vllm/v1/spec_decode/llm_base_proposer.py `propose`) are wrapped, after
the engine is built (so its warm-up runs are not captured), to keep their first calls.

DFlash (`dflash`: qwen3_dflash.py, vllm/v1/spec_decode/dflash.py), first call of each:
- `combine_hidden_states`: `target_features` [T, n_ctx*H], the target's aux hidden
  states of the prompt, and `context` [T, H], their `fc` projection;
- `precompute_and_store_context_kv`: `context_positions` [T];
- `forward`: `block_ids` [K+1] and `block_positions` [K+1] (the query block),
  `block_hidden` [K+1, H] (after `norm`);
- `compute_logits`: `draft_logits` [K, V], the rows vLLM samples its drafts from.

EAGLE-3 (`eagle3`: llama_eagle3.py), the first K calls (one round's steps):
- `combine_hidden_states`: `target_features` and `context`, as above (first call);
- `forward`: `step_ids`, `step_positions` (all steps' rows in order: the prompt's
  [T] shifted ids at positions 0..T-1, then one row per later step);
- `compute_logits`: `draft_logits` [K, V], one row per step (-inf outside the draft
  vocabulary).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine, and its drafter, in this process

import torch
from safetensors.torch import save_file
from vllm_runner import DFLASH_MODULE, EAGLE3_MODULE, build_llm

CAPTURED = {
    "dflash": (
        "target_features",
        "context",
        "context_positions",
        "block_ids",
        "block_positions",
        "block_hidden",
        "draft_logits",
    ),
    "eagle3": ("target_features", "context", "step_ids", "step_positions", "draft_logits"),
}


def wrap_first(cls, name: str, count: int, keep) -> None:
    """Replace `cls.name` by a call-through that hands each of the first `count` calls'
    arguments and result to `keep(args, kwargs, result)`."""
    original = getattr(cls, name)
    done = []

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if len(done) < count:
            done.append(True)
            keep(args, kwargs, result)
        return result

    setattr(cls, name, wrapper)


def wrap_dflash(put) -> None:
    model_class = importlib.import_module(DFLASH_MODULE).DFlashQwen3ForCausalLM
    wrap_first(model_class, "combine_hidden_states", 1, lambda a, k, r: put(target_features=a[0], context=r))
    wrap_first(model_class, "precompute_and_store_context_kv", 1, lambda a, k, r: put(context_positions=a[1]))
    wrap_first(
        model_class,
        "forward",
        1,
        lambda a, k, r: put(block_ids=k["input_ids"], block_positions=k["positions"], block_hidden=r),
    )
    wrap_first(model_class, "compute_logits", 1, lambda a, k, r: put(draft_logits=r))


def wrap_eagle3(put, steps: int) -> None:
    model_class = importlib.import_module(EAGLE3_MODULE).Eagle3LlamaForCausalLM
    wrap_first(model_class, "combine_hidden_states", 1, lambda a, k, r: put(target_features=a[0], context=r))

    def step(args, kwargs, result):
        named = dict(zip(("input_ids", "positions"), args), **kwargs)
        put(step_ids=named["input_ids"], step_positions=named["positions"])

    wrap_first(model_class, "forward", steps, step)
    wrap_first(model_class, "compute_logits", steps, lambda a, k, r: put(draft_logits=r))


def capture(request: dict) -> dict[str, torch.Tensor]:
    """Decode the request's one prompt a few tokens, keeping the first draft round."""
    from vllm import SamplingParams  # an optional dependency, as in vllm_runner.py

    (prompt,) = request["prompts"]
    method = request.get("method", "dflash")
    llm = build_llm(request)
    kept: dict[str, list[torch.Tensor]] = {}

    def put(**named):
        for key, value in named.items():
            kept.setdefault(key, []).append(value.detach().to("cpu").clone().contiguous())

    if method == "eagle3":
        wrap_eagle3(put, request["num_speculative_tokens"])
    else:
        wrap_dflash(put)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], detokenize=False, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    missing = sorted(set(CAPTURED[method]) - set(kept))
    if missing:
        raise RuntimeError(
            f"vLLM's {method} drafter never produced {missing}: its proposer no longer calls its model class "
            "as this script expects"
        )
    return {key: torch.cat(values) if len(values) > 1 else values[0] for key, values in kept.items()}


def main(argv: list[str]) -> int:
    request_path, out_path = argv
    with open(request_path) as f:
        request = json.load(f)
    save_file(capture(request), out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
