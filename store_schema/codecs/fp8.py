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

import ml_dtypes
import numpy as np

from ..errors import NonFiniteStatesError

FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXPONENT = -6  # smallest normal: 2^-6
E4M3_MANTISSA_BITS = 3
_MAX_SCALE_EXPONENT = 126  # scales stay normal float32 (and their inverses finite)
# The largest magnitude e4m3 holds with any scale without its rounding reaching 2^128 (Inf in
# float32 and bf16): 4 significant bits round 1.9375 * 2^127 and above up to 2^128.
LARGEST_STORABLE = 1.9375 * 2.0**127


def quantize(states):
    """bf16 (or float) [..., hidden] torch tensor, on any device -> (float8_e4m3fn codes
    [..., hidden], float32 scales [...]) on the same device. Never waits for the device:
    a token holding NaN/Inf gets a NaN scale, which `refuse_nonfinite` turns into an
    error where the scales reach the host."""
    import torch  # torch only for tensors: the numpy path and `store_schema info` run without it

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
    import torch  # torch only for tensors: the numpy path and `store_schema info` run without it

    dtype = dtype or torch.bfloat16
    return (codes.float() * scales.float()[..., None]).to(dtype)


_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(FLOAT8_E4M3FN).astype(np.float32)


def float32(codes: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """numpy twin of `dequantize` (float32, exact: e4m3 times a power of two; the codes
    alone without `scales`), through a table of all 256 codes (ml_dtypes' own cast runs
    element by element)."""
    values = _E4M3_VALUES[codes.view(np.uint8)]
    if scales is not None:
        values *= np.asarray(scales, np.float32)[:, None]
    return values


BAD_SCALE = "not a positive power of two"  # what verify says of a scale `bad_scale_tokens` finds


def bad_scale_tokens(scales: np.ndarray) -> np.ndarray:
    """Tokens whose scale is not a positive power of two (NaN included)."""
    return np.flatnonzero(~(np.isfinite(scales) & (scales > 0)) | (np.frexp(scales)[0] != 0.5))
