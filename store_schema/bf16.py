"""bfloat16 for zarr-python 3.1, which has none built in.

Registered as the zarr-extensions `bfloat16` data type over `ml_dtypes.bfloat16`,
so any reader that knows that extension (zarr-python with this module imported,
tensorstore) reads the store. Values are stored as their raw little-endian bits:
the round trip is bit-exact, NaN payloads and subnormals included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DataTypeValidationError
from zarr.core.dtype.npy.float import BaseFloat

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    dtype_cls = type(BFLOAT16)
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_native_dtype(cls, dtype):
        if cls._check_native_dtype(dtype):
            return cls(endianness="little")
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected bfloat16")

    def to_native_dtype(self):
        return BFLOAT16

    @property
    def item_size(self) -> int:
        return 2

    def _cast_scalar_unchecked(self, data):
        return BFLOAT16.type(data)


def register() -> None:
    """Idempotent; done on import of `store_schema`."""
    data_type_registry.register(BFloat16._zarr_v3_name, BFloat16)


register()
