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
  `train.families.dflash.flex_mask` pads lengths to whole 128-tiles, so the kernels always
  see divisible lengths;
- the layer rule (full / sliding: the mask_mod's constants): 2 graphs at most;
- grad mode (training vs evaluation): x2;
- dtype: the trainer runs every evaluator under its own autocast, so one dtype per run.

That is 4 graphs for a training run. `FLEX_GRAPH_LIMIT` allows twice the worst
legitimate case (another dtype too: 8), and reaching it is an error that says why
(`fail_on_recompile_limit_hit`), never a silent fallback.

On a device with little shared memory per block (sm_120's ~99 KB) the kernels get smaller
tiles (`tiles_for`). Any other failure to compile or launch (a compiler error, a Triton
kernel whose tiles still do not fit) gives flex up for the
process with one line on stderr (`give_up_flex`): the drafter redoes that forward on the
split path and stays there (`train.families.dflash.attention.resolve_attention`). A failure in a
backward kernel is not caught here: it ends the step with torch's error.
"""

from __future__ import annotations

import sys

import torch

FLEX_GRAPH_LIMIT = 16
# Shared memory per block under which flex's default tiles at head_dim 128 may not fit (forward
# and backward): workstation and consumer parts (sm_86 / sm_89 / sm_120, ~99-100 KB) against
# 164 KB (A100) and 227 KB (H100, H200). There the kernels get tiles a quarter the size.
SMALL_SHARED_MEMORY = 160 * 1024
SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32}
# torch renamed `cache_size_limit` to `recompile_limit` (2.7); the loud failure exists from 2.6.
LIMIT_OPTION = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
FAIL_OPTION = "fail_on_recompile_limit_hit"


class FlexRecompileError(RuntimeError):
    """flex_attention needed more graphs than FLEX_GRAPH_LIMIT: an unplanned shape or dtype."""


class FlexUnavailable(RuntimeError):
    """flex_attention could not be compiled or launched here (a compiler error, a kernel
    that does not fit the device's shared memory): the drafter falls back to the split path."""


DISABLED: list[str] = []  # why flex was given up in this process (said once, on stderr)


def give_up_flex(error: BaseException) -> FlexUnavailable:
    """Record why flex failed, say it once, and return the error the drafter catches."""
    root: BaseException = error
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner  # the compiler's own error, not dynamo's wrapper
    text = str(root).strip()
    reason = f"{type(root).__name__}: {text.splitlines()[0] if text else ''}"
    if not DISABLED:
        print(
            f"warning: flex_attention failed here ({reason[:300]}); the drafter uses the split path from now on "
            "(same values, more memory and time)",
            file=sys.stderr,
            flush=True,
        )
    DISABLED.append(reason)
    return FlexUnavailable(reason)


class CompiledFlex:
    """`torch.compile(flex_attention, dynamic=True)` called under the graph budget above.
    `backend` is torch.compile's (the default, inductor, is the fused kernel)."""

    def __init__(self, backend="inductor", limit: int = FLEX_GRAPH_LIMIT):
        from torch.nn.attention.flex_attention import flex_attention  # torch >= 2.5 only (pyproject allows 2.4)

        self.limit = limit
        self._fn = torch.compile(flex_attention, dynamic=True, backend=backend)
        self._tiles: dict[torch.device, dict | None] = {}

    def tiles(self, device: torch.device) -> dict | None:
        """The device's kernel tiles (`kernel_options`), asked once per device: a constant of
        its compiled graph, so no graph is added."""
        if device not in self._tiles:
            self._tiles[device] = kernel_options(device)
        return self._tiles[device]

    def __call__(self, q, k, v, block_mask, scale):
        mark_dynamic_tiles(block_mask)
        options = {LIMIT_OPTION: self.limit}
        if hasattr(torch._dynamo.config, FAIL_OPTION):
            options[FAIL_OPTION] = True
        try:
            with torch._dynamo.config.patch(**options):
                return self._fn(
                    q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=self.tiles(q.device)
                )
        except Exception as error:
            if type(error).__name__ == "FailOnRecompileLimitHit":
                raise FlexRecompileError(
                    f"flex_attention needed more than {self.limit} compiled graphs (q {tuple(q.shape)} {q.dtype}, "
                    f"grad {torch.is_grad_enabled()}): a caller outside the trainer's autocast, or a new mask rule; "
                    "see train/families/dflash/flex_compile.py"
                ) from error
            if isinstance(error, torch.OutOfMemoryError):
                raise  # memory, not the kernel: the caller's batch is too large for any path
            raise give_up_flex(error) from error


def tiles_for(shared_memory: int | None) -> dict | None:
    """flex's kernel tiles for a device with `shared_memory` bytes per block (None: flex's
    defaults). The small tiles divide the BlockMask's 128-token blocks, as flex requires."""
    if shared_memory is not None and shared_memory < SMALL_SHARED_MEMORY:
        return dict(SMALL_TILES)
    return None


def kernel_options(device: torch.device) -> dict | None:
    """`tiles_for` this device (CUDA's opt-in shared memory per block; None elsewhere)."""
    if device.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(device)
    return tiles_for(getattr(properties, "shared_memory_per_block_optin", None))


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
