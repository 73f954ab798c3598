"""flex_attention compiled once per process, with a known, bounded number of graphs.

torch._dynamo keeps at most `recompile_limit` (8) graphs per function and, past it,
silently runs the function eagerly: for flex_attention that is the unfused path,
which materialises every score (8,192 x 11,264 per head at 512 anchors over 3,072
tokens). Left alone, the drafter's flex graphs were one per sequence length (the
BlockMask's tile counts were guarded as static sizes), two mask rules each, again
for the held-out pass (no_grad), again for AcceptanceEval in fp32: the limit was hit
within a few steps. What the graphs now depend on:

- shapes: never. Every length is dynamic (`dynamic=True` for q/k/v, and the
  BlockMask's tile tensors are marked dynamic here before each call), and
  `train.drafter.flex_mask` pads lengths to whole 128-tiles, so the kernels always
  see divisible lengths;
- the layer rule (full / sliding: the mask_mod's constants): 2 graphs at most;
- grad mode (training vs evaluation): x2;
- dtype: the trainer runs every evaluator under its own autocast, so one dtype per run.

That is 4 graphs for a training run. `FLEX_GRAPH_LIMIT` allows twice the worst
legitimate case (another dtype too: 8), and reaching it is an error that says why
(`fail_on_recompile_limit_hit`), never a silent fallback.
"""

from __future__ import annotations

import torch

FLEX_GRAPH_LIMIT = 16


class FlexRecompileError(RuntimeError):
    """flex_attention needed more graphs than FLEX_GRAPH_LIMIT: an unplanned shape or dtype."""


class CompiledFlex:
    """`torch.compile(flex_attention, dynamic=True)` called under the graph budget above.
    `backend` is torch.compile's (the default, inductor, is the fused kernel)."""

    def __init__(self, backend="inductor", limit: int = FLEX_GRAPH_LIMIT):
        from torch.nn.attention.flex_attention import flex_attention  # torch >= 2.5 only (pyproject allows 2.4)

        self.limit = limit
        self._fn = torch.compile(flex_attention, dynamic=True, backend=backend)

    def __call__(self, q, k, v, block_mask, scale):
        mark_dynamic_tiles(block_mask)
        try:
            with torch._dynamo.config.patch(recompile_limit=self.limit, fail_on_recompile_limit_hit=True):
                return self._fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            raise FlexRecompileError(
                f"flex_attention needed more than {self.limit} compiled graphs (q {tuple(q.shape)} {q.dtype}, "
                f"grad {torch.is_grad_enabled()}): a caller outside the trainer's autocast, or a new mask rule; "
                "see train/drafter/flex_compile.py"
            ) from error


def mark_dynamic_tiles(block_mask) -> None:
    """Mark the BlockMask's tile-count dimensions dynamic, so a new sequence length
    reuses the graph instead of compiling another."""
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        tensor = getattr(block_mask, name, None)
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, list(range(2, tensor.dim())))
