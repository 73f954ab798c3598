"""How the writer holds a layer's states in memory, written once for the writer, the
encoder and the layer statistics: per-thread scratch buffers, and the test for states
held channel-major (tokens contiguous, as fp8 codes leave the device)."""

from __future__ import annotations

import threading

import numpy as np

_BUFFERS = threading.local()  # each thread's scratch buffers, by slot


def scratch(slot: str, nbytes: int) -> np.ndarray:
    """`nbytes` uninitialised bytes of this thread's buffer `slot`, grown as needed and
    valid until the thread's next call for that slot: reused shard after shard, since a
    fresh array per layer cost the writer more in page faults than the copies into it."""
    buffers: dict[str, np.ndarray] = _BUFFERS.__dict__.setdefault("by_slot", {})
    buffer = buffers.get(slot)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[slot] = np.empty(nbytes, np.uint8)
    return buffer[:nbytes]


def is_channel_major(array: np.ndarray) -> bool:
    """Whether [tokens, channels] `array` holds each channel's tokens contiguously."""
    return array.ndim == 2 and array.strides[0] == array.itemsize and array.shape[1] > 1
