"""The opt-in 4-bit store: each context layer as e2m1 codes (values 0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives) with one power-of-two scale per block of `BLOCK` channels
of a token, as OCP's MXFP4 (block 32, an 8-bit exponent as the scale).

Stored as two arrays per layer: `layer_{L}` uint8 [tokens, hidden / 2], two codes a
byte (channel 2j in the low nibble, 2j+1 in the high one), and `layer_{L}_scale`
uint8 [tokens, hidden / 32], each block's scale exponent + 127 (the e8m0 encoding:
255 is NaN, written for a block holding NaN/Inf and refused at write).

The scale is the smallest power of two with `max|x| / scale <= 6` (MXFP4's own rule
takes `floor(log2 max) - 2` and clips the top of a block; this one never saturates).
Codes round to nearest, ties to even, exactly as `ml_dtypes.float4_e2m1fn` casts.
Dequantizing is exact in bf16 (2 significant bits times a power of two). Chosen by
measurement (`benchmarks/fp4_formats.py`, RESULTS.md 2026-12-07, the proxy store's
states): block 32 with a power-of-two scale stores 0.226 of raw bf16 at a relative
RMS error of 0.120; block 16 0.241 at 0.115; NVIDIA's NVFP4 shape (block 16, an
e4m3 scale under a per-token one) 0.260 at 0.099.

The arithmetic is torch on any device (extraction quantizes on the GPU, the
trainer dequantizes there); `float32` is the numpy twin for the writer's statistics."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import NonFiniteStatesError

BLOCK = 32  # channels sharing one scale
E2M1_MAX = 6.0
SCALE_BIAS = 127  # stored byte = exponent + 127 (e8m0)
NAN_SCALE = 255  # e8m0's NaN: a block that held NaN/Inf
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127
# e2m1's magnitudes by 3-bit code, and the rounding boundaries between neighbours: a
# magnitude exactly on a boundary goes to the even code (ties to even)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # boundaries whose lower neighbour has the even code
_TIES_UP = (0.75, 1.75, 3.5)  # ... and whose upper neighbour has it
E2M1_VALUES = np.array(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), np.float32)  # by 4-bit code
assert np.array_equal(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32), E2M1_VALUES)


def columns(hidden_size: int) -> tuple[int, int]:
    """(code bytes, scales) per token of a `hidden_size`-wide layer; a width that is
    not a multiple of `BLOCK` is refused (every target's hidden size is)."""
    if hidden_size % BLOCK:
        raise ValueError(f"an fp4 store needs a hidden size divisible by {BLOCK}, got {hidden_size}")
    return hidden_size // 2, hidden_size // BLOCK


def quantize(states):
    """bf16 (or float) [..., hidden] torch tensor, on any device -> (uint8 codes
    [..., hidden / 2], uint8 scale exponents [..., hidden / 32]) on the same device.
    Never waits for the device: a block holding NaN/Inf gets scale `NAN_SCALE`, which
    `refuse_nonfinite` turns into an error where the scales reach the host."""
    import torch  # torch only for tensors: the numpy path and `store_schema info` run without it

    columns(states.shape[-1])
    x = states.float().unflatten(-1, (-1, BLOCK))  # [..., blocks, 32]
    amax = x.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    # the smallest e with amax / 2^e <= 6, i.e. e = ceil(log2(amax / 6))
    mantissa, exponent = torch.frexp(amax / E2M1_MAX)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, _MIN_EXPONENT))
    exponent = exponent.clamp(_MIN_EXPONENT, _MAX_EXPONENT)
    exponent = exponent + (torch.ldexp(amax, -exponent) > E2M1_MAX).to(exponent.dtype)  # amax / 6 rounded down
    scaled = torch.ldexp(x, -exponent[..., None])
    codes = _e2m1_codes(scaled).flatten(-2)  # [..., hidden] uint8, one code each
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + SCALE_BIAS).to(torch.uint8)
    return packed, torch.where(finite, scales, torch.full_like(scales, NAN_SCALE))


def _e2m1_codes(scaled):
    """4-bit codes (uint8) of values already within [-6, 6]: the magnitude's index
    counted over the rounding boundaries it passes, then the sign bit."""
    import torch  # torch only for tensors: the numpy path and `store_schema info` run without it

    magnitude = scaled.abs()
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for boundary in _TIES_DOWN:
        index += magnitude > boundary
    for boundary in _TIES_UP:
        index += magnitude >= boundary
    return index | (torch.signbit(scaled).to(torch.uint8) << 3)


def dequantize(codes, scales, dtype=None):
    """uint8 codes [..., hidden / 2] and scale exponents [..., hidden / 32] (torch, any
    device) -> states in `dtype` (default bf16: exact, see the module docstring)."""
    import torch  # torch only for tensors: the numpy path and `store_schema info` run without it

    dtype = dtype or torch.bfloat16
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)  # [..., hidden]
    values = _e2m1_table(codes.device)[nibbles.long()]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    blocks = torch.ldexp(values.unflatten(-1, (-1, BLOCK)), exponents[..., None].float())
    return blocks.flatten(-2).to(dtype)


_TABLES: dict = {}  # device -> E2M1_VALUES there: copied once, not once per layer and sample


def _e2m1_table(device):
    import torch  # torch only for tensors: the numpy path and `store_schema info` run without it

    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = torch.from_numpy(E2M1_VALUES).to(device)
    return _TABLES[key]


def float32(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """numpy twin of `dequantize` (float32, exact): the writer's and verify's statistics."""
    nibbles = np.stack((codes & 0xF, codes >> 4), axis=-1).reshape(*codes.shape[:-1], -1)
    values = E2M1_VALUES[nibbles].reshape(*codes.shape[:-1], -1, BLOCK)
    with np.errstate(over="ignore"):
        blocks = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    return blocks.reshape(*codes.shape[:-1], -1)


BAD_SCALE = "NaN (a block of the token held NaN/Inf)"  # what verify says of a token `bad_scale_tokens` finds


def bad_scale_tokens(scales: np.ndarray) -> np.ndarray:
    """Tokens (rows of uint8 [tokens, blocks]) with a block scale that is NaN."""
    return np.flatnonzero((scales == NAN_SCALE).any(axis=-1))


def refuse_nonfinite(scales: np.ndarray, what: str) -> None:
    """NonFiniteStatesError naming `what` and the first token whose states held NaN/Inf."""
    bad = bad_scale_tokens(scales)
    if bad.size:
        raise NonFiniteStatesError.at_tokens(bad, what, " (an fp4 store)")
