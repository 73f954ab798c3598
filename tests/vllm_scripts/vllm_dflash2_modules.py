"""Run vLLM's own DFlash 2 modules (vllm/model_executor/models/qwen3_dflash2.py) on
given weights and inputs, on CPU, to compare with this project's.

vLLM serves DFlash 2 only on its V2 model runner (GPU), so a served drafter cannot
be captured on CPU as vllm_logits.py captures DFlash; what DFlash 2 adds to the
DFlash layer can be run alone: `DFlashGroupedConv.prepare` / `finish` (the
block-local convolution, vLLM's CPU path) and the candidate selector's edge scores
(`CandidateSelector.forward`'s body: `hidden_projection`, then `_score_edges`, the
[blocks, L, K predecessors, K candidates] scores its Triton walk reads).

Run as a script by the vLLM environment's python (`python vllm_dflash2_modules.py
IN.safetensors OUT.safetensors`); it imports only the standard library, vLLM, torch
and safetensors, never this project. IN holds `conv.base_kernel` [2, k, H],
`conv.kernel_projection` [2*k*G, H], `conv.input` and `conv.sublayer_output`
[rows, H] (whole blocks of `block_size` rows), the selector's `predecessor_codebook`,
`successor_codebook` [V, r] and `hidden_projection` [r, H], `hidden` [b, L, H],
`unary` and `candidate_ids` [b, L, K], `anchor_ids` [b]; its metadata `block_size`
and `group_size`. OUT: `prepared`, `finished` [rows, H] and `edge_scores` [b, L, K, K].
"""

from __future__ import annotations

import importlib
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MODULE = "vllm.model_executor.models.qwen3_dflash2"


def run(inputs: dict[str, torch.Tensor], block_size: int, group_size: int) -> dict[str, torch.Tensor]:
    # vLLM only here: this file is also read where vLLM is not installed (an optional dependency)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):  # ReplicatedLinear needs a (one-process) model-parallel group
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{tempfile.mktemp()}"
        )
        initialize_model_parallel(1, 1)
        dflash2 = importlib.import_module(MODULE)
        base = inputs["conv.base_kernel"]
        conv = dflash2.DFlashGroupedConv(
            hidden_size=base.shape[-1],
            taps=base.shape[1],
            group_size=group_size,
            block_size=block_size,
            params_dtype=torch.float32,
            prefix="conv",
        )
        projection = dflash2.ReplicatedLinear(
            base.shape[-1],
            inputs["selector.hidden_projection"].shape[0],
            bias=False,
            params_dtype=torch.float32,
            prefix="selector",
            return_bias=False,
        )
        with torch.no_grad():
            conv.base_kernel.copy_(base)
            conv.kernel_projection.weight.copy_(inputs["conv.kernel_projection"])
            projection.weight.copy_(inputs["selector.hidden_projection"])
        for linear in (conv.kernel_projection, projection):
            linear.quant_method.process_weights_after_loading(linear)
        with torch.no_grad():
            prepared, coefficients = conv.prepare(inputs["conv.input"])
            finished = conv.finish(inputs["conv.sublayer_output"], coefficients)
            top_k = inputs["candidate_ids"].shape[-1]
            scores = dflash2._score_edges(
                inputs["selector.predecessor_codebook"],
                inputs["selector.successor_codebook"],
                inputs["candidate_ids"],
                inputs["unary"],
                projection(inputs["hidden"]),
                inputs["anchor_ids"],
                top_k,
            )
    return {"prepared": prepared, "finished": finished, "edge_scores": scores}


def main(argv: list[str]) -> int:
    in_path, out_path = argv
    with safe_open(in_path, framework="pt") as f:
        inputs = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    outputs = run(inputs, int(metadata["block_size"]), int(metadata["group_size"]))
    save_file({k: v.contiguous() for k, v in outputs.items()}, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
