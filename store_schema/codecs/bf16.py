"""bfloat16 as numpy sees it (`ml_dtypes.bfloat16`): what a store's bf16 layers hold.

zarr-python 3.1 has no bfloat16; its data type is registered by
`store_schema.codecs.zarr_dtypes` (imported by whatever opens a store)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
