"""The opt-in fp8 store: each context layer as float8 e4m3 (`float8_e4m3fn`: max 448,
no infinities) with one scale per token in a sibling array.

The scale is a power of two, the smallest with `max|x| / scale <= 448`: no value
saturates, dividing by it is exact, and so is dequantizing back to bf16 (4
significant bits times a power of two fit bf16's 8). The only error is e4m3's
rounding: at most 2^-4 of a value in the normal range (|x| >= 2^-6 scale) and
2^-10 scale below it. NaN and Inf are refused at write: e4m3fn has no infinity,
and a NaN would poison the token's scale (so are the few bf16 values within 3 % of
bf16's max, whose e4m3 rounding is Inf: `LARGEST_STORABLE`).

The zarr data type `float8_e4m3fn` over `ml_dtypes.float8_e4m3fn` is registered by
`store_schema.codecs.zarr_dtypes` (imported by whatever opens a store), so this module's
numerics need no zarr."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from ..errors import NonFiniteStatesError

if TYPE_CHECKING:
    import torch

FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXPONENT = -6  # smallest normal: 2^-6
E4M3_MANTISSA_BITS = 3
_MAX_SCALE_EXPONENT = 126  # scales stay normal float32 (and their inverses finite)
# The largest magnitude e4m3 holds with any scale without its rounding reaching 2^128 (Inf in
# float32 and bf16): 4 significant bits round 1.9375 * 2^127 and above up to 2^128.
LARGEST_STORABLE = 1.9375 * 2.0**127


@dataclass(frozen=True)
class QuantizedStates:
    """One sample's layer already quantized (`quantize`'s output), e.g. on the GPU
    before the device-to-host copy, which halves that copy."""

    codes: torch.Tensor  # float8_e4m3fn [tokens, hidden]
    scales: torch.Tensor  # float32 [tokens]

    @property
    def shape(self) -> tuple:
        return tuple(self.codes.shape)


def quantize(states):
    """bf16 (or float) [..., hidden] torch tensor, on any device -> (float8_e4m3fn codes
    [..., hidden], float32 scales [...]) on the same device. Never waits for the device:
    a token holding NaN/Inf gets a NaN scale, which `refuse_nonfinite` turns into an
    error where the scales reach the host."""
    import torch

    x = states.float()
    amax = x.abs().amax(dim=-1) if x.shape[-1] else torch.zeros(x.shape[:-1], device=x.device)
    finite = amax < LARGEST_STORABLE  # False for NaN and Inf too
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    # the smallest power of two 2^e with amax / 2^e <= 448, i.e. e = ceil(log2(amax / 448))
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    exponent = exponent.clamp(-_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    # amax / 448 may have rounded down across a power of two: step up where it still saturates
    exponent = exponent + (torch.ldexp(amax, -exponent) > E4M3_MAX).to(exponent.dtype)
    codes = torch.ldexp(x, -exponent[..., None]).to(torch.float8_e4m3fn)
    scales = torch.ldexp(torch.ones_like(amax), exponent)
    return codes, torch.where(finite, scales, torch.full_like(scales, float("nan")))


def refuse_nonfinite(scales: np.ndarray, what: str) -> None:
    """NonFiniteStatesError naming `what` and the first token whose states held NaN/Inf
    (a NaN scale from `quantize`)."""
    bad = np.flatnonzero(~np.isfinite(scales))
    if bad.size:
        raise NonFiniteStatesError.at_tokens(bad, what, f" (an fp8 store any beyond +-{LARGEST_STORABLE:.3g})")


def dequantize(codes, scales, dtype=None):
    """float8_e4m3fn codes [tokens, hidden] and float32 scales [tokens] (torch, any
    device) -> states in `dtype` (default bf16: exact, see the module docstring)."""
    import torch

    dtype = dtype or torch.bfloat16
    return (codes.float() * scales.float()[..., None]).to(dtype)


def as_bf16(stored, scales=None, device=None):
    """States as a store holds them (bf16; or float8 codes with their `scales`) as bf16
    on `device` (default: where they are). They move first, then are dequantized, so
    only the stored bytes cross (half of bf16's for fp8)."""
    if device is not None:
        stored = stored.to(device, non_blocking=True)
        scales = None if scales is None else scales.to(device, non_blocking=True)
    return stored if scales is None else dequantize(stored, scales)
