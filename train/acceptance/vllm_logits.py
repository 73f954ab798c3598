"""Capture vLLM's DFlash drafter on its first draft round of one prompt: its inputs
and its draft logits, saved with safetensors, to compare with this project's drafter.

Run as a script by the vLLM environment's python (`python vllm_logits.py
REQUEST.json OUT.safetensors`); like vllm_runner.py (whose `build_llm` it uses) it
imports only the standard library, vLLM, torch and safetensors, never this project.
The request is vllm_runner's with one prompt in `prompts`.

vLLM's drafter attention reads the running engine's KV cache and forward context, so
the drafter is not run alone: a real engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and the methods of its DFlash model class that
the proposer calls (vllm/v1/spec_decode/llm_base_proposer.py `propose`,
vllm/v1/spec_decode/dflash.py) are wrapped, after the engine is built (so its
warm-up runs are not captured), to keep the first call of each:

- `combine_hidden_states`: `target_features` [T, n_ctx*H], the target's aux hidden
  states of the prompt, and `context` [T, H], their `fc` projection;
- `precompute_and_store_context_kv`: `context_positions` [T];
- `forward`: `block_ids` [K+1] and `block_positions` [K+1] (the query block),
  `block_hidden` [K+1, H] (after `norm`);
- `compute_logits`: `draft_logits` [K, V], the rows vLLM samples its drafts from.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine, and its drafter, in this process

import torch
from safetensors.torch import save_file
from vllm_runner import DFLASH_MODULE, build_llm

CAPTURED = (
    "target_features",
    "context",
    "context_positions",
    "block_ids",
    "block_positions",
    "block_hidden",
    "draft_logits",
)


def wrap_once(cls, name: str, keep) -> None:
    """Replace `cls.name` by a call-through that hands the first call's arguments and
    result to `keep(args, kwargs, result)`."""
    original = getattr(cls, name)
    done = []

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not done:
            done.append(True)
            keep(args, kwargs, result)
        return result

    setattr(cls, name, wrapper)


def capture(request: dict) -> dict[str, torch.Tensor]:
    """Decode the request's one prompt a few tokens, keeping the first draft round."""
    from vllm import SamplingParams  # an optional dependency, as in vllm_runner.py

    (prompt,) = request["prompts"]
    llm = build_llm(request)
    model_class = importlib.import_module(DFLASH_MODULE).DFlashQwen3ForCausalLM
    tensors: dict[str, torch.Tensor] = {}

    def put(**named):
        tensors.update({key: value.detach().to("cpu").clone().contiguous() for key, value in named.items()})

    wrap_once(model_class, "combine_hidden_states", lambda a, k, r: put(target_features=a[0], context=r))
    wrap_once(model_class, "precompute_and_store_context_kv", lambda a, k, r: put(context_positions=a[1]))
    wrap_once(
        model_class,
        "forward",
        lambda a, k, r: put(block_ids=k["input_ids"], block_positions=k["positions"], block_hidden=r),
    )
    wrap_once(model_class, "compute_logits", lambda a, k, r: put(draft_logits=r))
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], detokenize=False, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    missing = sorted(set(CAPTURED) - set(tensors))
    if missing:
        raise RuntimeError(
            f"vLLM's DFlash drafter never produced {missing}: its proposer no longer calls "
            f"{DFLASH_MODULE}.DFlashQwen3ForCausalLM as this script expects"
        )
    return tensors


def main(argv: list[str]) -> int:
    request_path, out_path = argv
    with open(request_path) as f:
        request = json.load(f)
    save_file(capture(request), out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
