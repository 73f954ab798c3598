"""The dtypes a store can hold hidden states in, and what each implies: the zarr data
type of the layer arrays, the raw bits readers handle, whether per-token scales sit
beside them, and how NaN/Inf look in the bits.

`bfloat16` is the default and lossless; `fp8_e4m3` (`--store-dtype fp8_e4m3`) halves
the raw size (see `store_schema.codecs.fp8`). The fingerprint records the name, so one
store never mixes them."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class StoreDtype:
    name: str  # as the fingerprint records it and --store-dtype spells it
    zarr_name: str  # the zarr data type of the layer arrays
    values: np.dtype  # numpy (ml_dtypes) type of the values
    bits: np.dtype  # unsigned integer type of their raw bits
    nonfinite_mask: int  # bits that are all set exactly in NaN/Inf values
    scaled: bool  # a float32 scale per token in a sibling array
    size_ratio: float  # store bytes / raw bf16 bytes that size estimates assume: store_bench --quick's, docs/store.md
    default_codec: str  # `encoding.CodecConfig.name` of new stores of this dtype (measured: store_bench)
    # raw bf16 MB/s one core writes (statistics, encode, crc32c, files; fp8 from device-quantized codes)
    # at the full job's shard geometry: store_bench --quick's job_geometry_write_mb_s_per_core, from
    # which `plan --dry-run` sizes the writer cores
    write_mb_s_per_core: float

    @property
    def itemsize(self) -> int:
        return self.values.itemsize

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
)
SPACE_HEADROOM = 0.10  # what the free-space check asks beyond the expected size: real states compress differently
STORE_DTYPES = {d.name: d for d in (BFLOAT16_STORE, FP8_E4M3_STORE)}
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
    or Inf: an exponent of all ones, tested on the integers (no float conversion)."""
    mask = bits.dtype.type(dtype.nonfinite_mask)
    return np.flatnonzero((np.bitwise_and(bits, mask) == mask).any(axis=1))
