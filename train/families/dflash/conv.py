"""DFlash 2's block-local grouped dynamic convolution (reference: `dflash` 0.1.0's
`GroupedDynamicCausalConv`; the same parameter names and layout).

Around a sublayer (attention or MLP), `prepare` mixes each row of a block with the
k-1 rows before it *in the same block* before the sublayer, and `finish` does the
same to the sublayer's output. Row t's output is

    sum over taps o < k of (base[o] + dynamic[t, o, group]) * x[t - o]

where `base` is a per-channel kernel (`base_kernel` [2, k, H]: one per side) and
`dynamic` is computed from the sublayer's (normed) input row t by
`kernel_projection` (H -> 2 * k * G, G = H / group_size groups of channels; both
sides' coefficients from the one projection, laid out [side, tap, group]).

Block-local: a tap never reaches across a block's start, so the anchor row has no
predecessor. Rows are given as whole blocks ([..., n * block_size, H]): in training
many blocks of one sequence side by side, at decode time the one block drafted.
The identity start (base tap 0 = 1, everything else 0) leaves every row unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIDES = 2  # prepare (before the sublayer) and finish (after it)


class BlockConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(SIDES, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, SIDES * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity start: base tap 0 = 1, the other taps and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the coefficients `finish` takes
        (computed from this input, as the reference does)."""
        coefficients = self.kernel_projection(x).unflatten(-1, (SIDES, self.kernel_size, self.groups))
        return self._convolve(x, coefficients[..., 0, :, :], 0, block_size), coefficients[..., 1, :, :]

    def finish(self, x: torch.Tensor, coefficients: torch.Tensor, block_size: int) -> torch.Tensor:
        """The convolved sublayer output."""
        return self._convolve(x, coefficients, 1, block_size)

    def _convolve(self, x: torch.Tensor, coefficients: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        """x [..., n * block_size, H]; coefficients [..., n * block_size, k, G]."""
        if x.shape[-2] % block_size:
            raise ValueError(f"{x.shape[-2]} rows are not whole blocks of {block_size}")
        rows = x.reshape(-1, block_size, self.groups, self.group_size)
        taps = coefficients.reshape(-1, block_size, self.kernel_size, self.groups, 1)
        base = self.base_kernel[side].view(self.kernel_size, self.groups, self.group_size).to(x.dtype)
        out = (base[0] + taps[:, :, 0]) * rows
        for tap in range(1, min(self.kernel_size, block_size)):
            earlier = F.pad(rows[:, :-tap], (0, 0, 0, 0, tap, 0))  # row t sees row t - tap of its own block
            out = out + (base[tap] + taps[:, :, tap]) * earlier
        return out.reshape(x.shape)
