"""A layer's values as the writer encodes them: each sample's states as bf16 or as
the store dtype's codes and scales (quantized here, or already on a device), joined
across the shard's samples into one array in the layout they came in."""

from __future__ import annotations

import numpy as np
import torch

from .codecs.arrays import RowBlocks, is_channel_major, layer_buffer
from .codecs.bf16 import BFLOAT16
from .dtypes import QuantizedStates, StoreDtype


def as_bf16_numpy(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        if array.dtype != torch.bfloat16:
            array = array.to(torch.bfloat16)
        return array.detach().cpu().contiguous().view(torch.int16).numpy().view(BFLOAT16)
    array = np.asarray(array)
    return array if array.dtype == BFLOAT16 else array.astype(BFLOAT16)


def joined_layer(parts: list[np.ndarray]) -> np.ndarray:
    """The samples' [tokens, hidden] states of one layer as one array, held as they came:
    channel-major where every sample's are (fp8 codes leave the device so: the
    `channels` codec then cuts its streams without a transpose), else row-major. The
    array lies in this thread's scratch buffer (`arrays.layer_buffer`), valid until its next call."""
    tokens, hidden = sum(len(part) for part in parts), parts[0].shape[1]
    if not all(is_channel_major(part) for part in parts):
        return RowBlocks(parts).joined()
    joined = layer_buffer((hidden, tokens), parts[0].dtype)
    start = 0
    for part in parts:
        joined[:, start : start + len(part)] = part.T
        start += len(part)
    return joined.T


def bf16_values(states, what: str) -> np.ndarray:
    if isinstance(states, QuantizedStates):
        raise ValueError(f"{what}: quantized states offered to a bfloat16 store")
    return as_bf16_numpy(states)


def bf16_tensor(states) -> torch.Tensor:
    """bf16 states (torch or numpy) as a torch tensor."""
    if isinstance(states, torch.Tensor):
        return states.to(torch.bfloat16)
    return torch.from_numpy(as_bf16_numpy(states).view(np.int16)).view(torch.bfloat16)


def quantized_values(states, what: str, dtype: StoreDtype) -> tuple[np.ndarray, np.ndarray]:
    """(codes [tokens, columns] as `dtype` stores them, scales) of one sample's layer."""
    if not isinstance(states, QuantizedStates):
        states = dtype.quantized(states if isinstance(states, torch.Tensor) else bf16_tensor(states))
    elif states.values_per_code != dtype.values_per_code or states.codes.element_size() != dtype.itemsize:
        raise ValueError(f"{what}: states quantized as {states.codes.dtype} offered to a {dtype.name} store")
    scales = states.scales.detach().cpu().numpy().astype(dtype.scale_zarr_name, copy=False)
    dtype.lossy.refuse_nonfinite(scales, what)
    return states.codes.detach().cpu().view(torch.uint8).numpy().view(dtype.values), scales  # in its layout
