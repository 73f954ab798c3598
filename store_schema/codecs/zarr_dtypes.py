"""The zarr data types a store's hidden states use, which zarr-python 3.1 lacks:
`bfloat16` (zarr-extensions' name, so tensorstore and other readers that know the
extension read the store) and `float8_e4m3fn` (LLVM / ml_dtypes / torch spelling;
zarr-extensions' `float8_e4m3` is the IEEE-like variant with infinities and a max
of 240). Values are stored as their raw little-endian bits: bit-exact round trips,
NaN payloads and subnormals included.

Registered on import. Every module that opens a store (reader, writer, plan_io)
imports this one, so `import store_schema` alone does not import zarr; plain
zarr-python reads a store after `import store_schema.codecs.zarr_dtypes`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DataTypeValidationError
from zarr.core.dtype.npy.float import BaseFloat

from .bf16 import BFLOAT16
from .fp8 import FLOAT8_E4M3FN


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


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(BaseFloat):
    dtype_cls = type(FLOAT8_E4M3FN)
    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_native_dtype(cls, dtype):
        if cls._check_native_dtype(dtype):
            return cls(endianness="little")
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected float8_e4m3fn")

    def to_native_dtype(self):
        return FLOAT8_E4M3FN

    @property
    def item_size(self) -> int:
        return 1

    def _cast_scalar_unchecked(self, data):
        return FLOAT8_E4M3FN.type(data)


def register() -> None:
    """Idempotent; done on import."""
    for data_type in (BFloat16, Float8E4M3FN):
        data_type_registry.register(data_type._zarr_v3_name, data_type)


register()
