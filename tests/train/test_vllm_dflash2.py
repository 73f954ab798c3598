"""vLLM's own DFlash 2 modules (vllm/model_executor/models/qwen3_dflash2.py, CPU
build) compute what this project's DFlash 2 computes, in fp32: the block-local
convolution around a sublayer (`prepare` / `finish`, vLLM's CPU path, its blocks
cut by `block_size` rows), and the selector's edge scores, the lattice vLLM's Triton
walk reads, equal to our unary + `pair_scores` for every predecessor and candidate;
the greedy path through that lattice is our selector's walk. vLLM serves DFlash 2
only on its V2 model runner (GPU), so the whole drafter is not served on CPU
(tests/train/test_serve_check.py); tests/vllm_scripts/vllm_dflash2_modules.py runs the
modules alone in the vLLM environment's python.
"""

from __future__ import annotations

import pytest
import torch
from random_drafters import random_dflash2
from safetensors.torch import load_file, save_file
from served import VLLM_SCRIPTS, run_vllm_script

SCRIPT = VLLM_SCRIPTS / "vllm_dflash2_modules.py"
BLOCKS, BLOCK, TOLERANCE = 3, 8, 1e-4


def vllm_outputs(python: str, inputs: dict, metadata: dict, workdir) -> dict[str, torch.Tensor]:
    workdir.mkdir()
    save_file(
        {k: v.contiguous() for k, v in inputs.items()},
        workdir / "in.safetensors",
        metadata={k: str(v) for k, v in metadata.items()},
    )
    run_vllm_script(python, SCRIPT, workdir, "in.safetensors", "out.safetensors")
    return load_file(workdir / "out.safetensors")


@pytest.mark.slow  # vLLM runs in a child process
@torch.no_grad()
def test_vllm_dflash2_modules_compute_ours(qwen3_dir, vllm_python, tmp_path):
    drafter = random_dflash2(qwen3_dir)
    conv, selector = drafter.layers[1].mlp_conv, drafter.candidate_selector
    generator = torch.Generator().manual_seed(5)
    rows, sublayer_output = (torch.randn(BLOCKS * BLOCK, 64, generator=generator) for _ in range(2))
    hidden = torch.randn(BLOCKS, BLOCK - 1, 64, generator=generator)
    unary, candidates = selector.candidates(torch.randn(BLOCKS, BLOCK - 1, 512, generator=generator) * 3)
    anchors = torch.tensor([4, 90, 300])
    inputs = {
        "conv.base_kernel": conv.base_kernel,
        "conv.kernel_projection": conv.kernel_projection.weight,
        "conv.input": rows,
        "conv.sublayer_output": sublayer_output,
        "selector.predecessor_codebook": selector.predecessor_codebook,
        "selector.successor_codebook": selector.successor_codebook,
        "selector.hidden_projection": selector.hidden_projection.weight,
        "hidden": hidden,
        "unary": unary,
        "candidate_ids": candidates,
        "anchor_ids": anchors,
    }
    theirs = vllm_outputs(vllm_python, inputs, {"block_size": BLOCK, "group_size": conv.group_size}, tmp_path / "vllm")

    prepared, coefficients = conv.prepare(rows, BLOCK)
    assert (theirs["prepared"] - prepared).abs().max() < TOLERANCE
    assert (theirs["finished"] - conv.finish(sublayer_output, coefficients, BLOCK)).abs().max() < TOLERANCE

    top_k = candidates.shape[-1]
    previous = torch.cat([anchors[:, None, None].expand(-1, 1, top_k), candidates[:, :-1]], dim=1)  # [b, L, K]
    pairs = selector.pair_scores(
        hidden[:, :, None].expand(-1, -1, top_k, -1).reshape(-1, 64),
        previous.reshape(-1),
        candidates[:, :, None].expand(-1, -1, top_k, -1).reshape(-1, top_k),
    )
    ours = unary[:, :, None] + pairs.view(BLOCKS, BLOCK - 1, top_k, top_k)
    assert (theirs["edge_scores"] - ours).abs().max() < TOLERANCE

    for block in range(BLOCKS):  # the greedy path through vLLM's lattice is our walk
        logits = torch.full((BLOCK - 1, 512), -1e4).scatter(-1, candidates[block], unary[block])
        walk = selector.walk(hidden[block][None], logits[None], anchors[block][None])[0]
        index, path = 0, []
        for position in range(BLOCK - 1):
            index = int(theirs["edge_scores"][block, position, index].argmax())
            path.append(int(candidates[block, position, index]))
        assert walk.tolist() == path, block
