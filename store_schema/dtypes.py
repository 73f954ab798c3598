"""The dtypes a store can hold hidden states in, and what each implies: the zarr data
type of the layer arrays, the raw bits readers handle, whether per-token scales sit
beside them, and how NaN/Inf look in the bits.

`bfloat16` is the default and lossless; `fp8_e4m3` (`--store-dtype fp8_e4m3`) halves
the raw size (see `store_schema.codecs.fp8`), `fp4_e2m1` quarters it (block-scaled
4-bit codes, `store_schema.codecs.fp4`). The fingerprint records the name, so one
store never mixes them. The lossy dtypes' numerics sit in their `quantizer` module,
which every caller reaches through the dtype: quantize, dequantize, the float32
statistics, and which scales are bad."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from .codecs import fp4, fp8

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class QuantizedStates:
    """One sample's layer already quantized (a quantizer's `quantize` output), e.g. on
    the GPU before the device-to-host copy, which halves (fp8) or quarters (fp4) it."""

    codes: torch.Tensor  # fp8: float8_e4m3fn [tokens, hidden]; fp4: uint8 [tokens, hidden / 2]
    scales: torch.Tensor  # fp8: float32 [tokens]; fp4: uint8 [tokens, hidden / 32]
    values_per_code: int = 1  # fp4: two e2m1 values a byte

    @property
    def shape(self) -> tuple:
        """(tokens, hidden) of the states the codes stand for."""
        return (self.codes.shape[0], self.codes.shape[1] * self.values_per_code)


@dataclass(frozen=True)
class StoreDtype:
    name: str  # as the fingerprint records it and --store-dtype spells it
    zarr_name: str  # the zarr data type of the layer arrays
    values: np.dtype  # numpy (ml_dtypes) type of the values
    bits: np.dtype  # unsigned integer type of their raw bits
    nonfinite_mask: int | None  # bits that are all set exactly in NaN/Inf values (None: no such codes)
    scaled: bool  # scales in a sibling array (`quantizer` says their shape and meaning)
    size_ratio: float  # store bytes / raw bf16 bytes that size estimates assume: store_bench --quick's, docs/store.md
    default_codec: str  # `encoding.CodecConfig.name` of new stores of this dtype (measured: store_bench)
    # raw bf16 MB/s one core writes (statistics, encode, crc32c, files; fp8 from device-quantized codes)
    # at the full job's shard geometry: store_bench --quick's job_geometry_write_mb_s_per_core, from
    # which `plan --dry-run` sizes the writer cores
    write_mb_s_per_core: float
    torch_name: str  # torch dtype the stored values are read as
    quantizer: ModuleType | None = None  # fp8 / fp4 (their numerics); None: stored as the states are
    values_per_code: int = 1  # states per stored element (fp4: two codes a byte)
    scale_zarr_name: str = "float32"  # the zarr data type of the scale arrays
    description: str = ""  # what `info` says of the values beside the name

    @property
    def itemsize(self) -> int:
        return self.values.itemsize

    def stored_columns(self, hidden_size: int) -> int:
        """Columns of a layer array holding `hidden_size`-wide states."""
        return hidden_size // self.values_per_code

    def scale_shape(self, num_tokens: int, hidden_size: int) -> tuple[int, ...]:
        """Shape of a layer's scale array: fp8 one scale a token, fp4 one a block."""
        if self.quantizer is fp4:
            return (num_tokens, fp4.columns(hidden_size)[1])
        return (num_tokens,)

    def as_bf16(self, stored, scales=None, device=None):
        """States as this dtype stores them (values, and scales when `scaled`) as bf16
        on `device` (default: where they are). They move first, then are dequantized,
        so only the stored bytes cross."""
        if device is not None:
            stored = stored.to(device, non_blocking=True)
            scales = None if scales is None else scales.to(device, non_blocking=True)
        if self.quantizer is None:
            return stored
        return self.quantizer.dequantize(stored, scales)

    def float32(self, values: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """Stored values (numpy, rows of `values`, with their scales) as float32, exactly."""
        if self.quantizer is None:
            return np.left_shift(values.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
        return self.quantizer.float32(values, scales)

    @property
    def lossy(self) -> ModuleType:
        """The quantizer of a `scaled` dtype (`codecs.fp8`, `codecs.fp4`)."""
        if self.quantizer is None:
            raise ValueError(f"a {self.name} store holds states as they are, unquantized")
        return self.quantizer

    def quantized(self, states) -> QuantizedStates:
        """bf16 torch states [tokens, hidden] (any device) quantized as this dtype stores them."""
        codes, scales = self.lossy.quantize(states)
        return QuantizedStates(codes, scales, self.values_per_code)

    def expected_bytes(self, raw_bf16_bytes: int, ratio: float | None = None) -> int:
        """A store of this dtype holding `raw_bf16_bytes` of bf16 states, at `size_ratio`
        (or `ratio`): the one size `plan --dry-run` prints and `run` checks."""
        return int(round(raw_bf16_bytes * (self.size_ratio if ratio is None else ratio)))


BFLOAT16_STORE = StoreDtype(
    "bfloat16",
    "bfloat16",
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.uint16),
    0x7F80,
    scaled=False,
    size_ratio=0.614,
    default_codec="bytesplit",
    write_mb_s_per_core=463.0,
    torch_name="bfloat16",
)
FP8_E4M3_STORE = StoreDtype(
    "fp8_e4m3",
    "float8_e4m3fn",
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(np.uint8),
    0x7F,
    scaled=True,
    size_ratio=0.351,
    default_codec="channels",
    write_mb_s_per_core=623.0,
    torch_name="float8_e4m3fn",
    quantizer=fp8,
    description="float8 e4m3 + a float32 scale per token",
)
FP4_E2M1_STORE = StoreDtype(
    "fp4_e2m1",
    "uint8",
    np.dtype(np.uint8),
    np.dtype(np.uint8),
    None,
    scaled=True,
    size_ratio=0.167,  # store_bench's states; real stores measured 0.148 (demo) to 0.230 (proxy)
    default_codec="channels",
    write_mb_s_per_core=395.0,
    torch_name="uint8",
    quantizer=fp4,
    values_per_code=2,
    scale_zarr_name="uint8",
    description="e2m1 codes, two a byte, + a power-of-two scale per 32 values",
)
SPACE_HEADROOM = 0.10  # what the free-space check asks beyond the expected size: real states compress differently
STORE_DTYPES = {d.name: d for d in (BFLOAT16_STORE, FP8_E4M3_STORE, FP4_E2M1_STORE)}
_ALIASES = {"bf16": "bfloat16"}


def store_dtype(name: str) -> StoreDtype:
    """The store dtype called `name` (`bf16` is accepted for `bfloat16`)."""
    found = STORE_DTYPES.get(_ALIASES.get(name, name))
    if found is None:
        raise ValueError(f"unknown store dtype {name!r}; choose one of {', '.join(STORE_DTYPES)}")
    return found


def space_needed(expected_bytes: int) -> int:
    """The free space a store of `expected_bytes` is refused without: the size plus
    `SPACE_HEADROOM`, the one margin `plan --dry-run` prints and `run` checks."""
    return int(round(expected_bytes * (1 + SPACE_HEADROOM)))


def nonfinite_rows(bits: np.ndarray, dtype: StoreDtype) -> np.ndarray:
    """Indices of the rows of `bits` [rows, cols] (raw bits of `dtype`) holding a NaN
    or Inf: an exponent of all ones, tested on the integers (no float conversion). fp4
    codes have no such values (a scale says it: `quantizer.bad_scale_tokens`)."""
    if dtype.nonfinite_mask is None:
        return np.empty(0, np.int64)
    mask = bits.dtype.type(dtype.nonfinite_mask)
    return np.flatnonzero((np.bitwise_and(bits, mask) == mask).any(axis=1))
