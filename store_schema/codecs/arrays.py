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


def layer_buffer(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array of `shape` in this thread's scratch buffer for one layer."""
    return scratch("layer", shape[0] * shape[1] * dtype.itemsize).view(dtype).reshape(shape)


def is_channel_major(array: np.ndarray) -> bool:
    """Whether [tokens, channels] `array` holds each channel's tokens contiguously."""
    return array.ndim == 2 and array.strides[0] == array.itemsize and array.shape[1] > 1


class RowBlocks:
    """A layer's [tokens, columns] values as its samples' row-major blocks, not joined:
    the bytesplit encoder splits each chunk's byte streams straight from the block that
    holds its rows, and the statistics gather their rows across blocks, so a bf16 shard
    is never copied whole into one array (RESULTS.md: what that saved). `np.asarray`
    joins it, for everything else."""

    def __init__(self, blocks: list[np.ndarray]):
        if not blocks or any(b.ndim != 2 or b.shape[1:] != blocks[0].shape[1:] for b in blocks):
            raise ValueError("row blocks must be 2-D arrays of one width")
        if any(b.dtype != blocks[0].dtype for b in blocks):
            raise ValueError("row blocks must share one dtype")
        self.blocks = blocks
        self.starts = np.cumsum([0, *(len(b) for b in blocks)])
        self.shape = (int(self.starts[-1]), int(blocks[0].shape[1]))
        self.dtype = blocks[0].dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def view(self, dtype) -> "RowBlocks":
        return RowBlocks([block.view(dtype) for block in self.blocks])

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) (clipped to the layer): a view where one block holds them
        all, else a fresh array joining the pieces."""
        stop = min(stop, len(self))
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        if stop <= self.starts[first + 1]:
            return self.blocks[first][start - self.starts[first] : stop - self.starts[first]]
        pieces, k = [], first
        while k < len(self.blocks) and self.starts[k] < stop:
            lo, hi = max(start, self.starts[k]), min(stop, self.starts[k + 1])
            pieces.append(self.blocks[k][lo - self.starts[k] : hi - self.starts[k]])
            k += 1
        return np.concatenate(pieces)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The rows `indices`, in that order, gathered from the blocks."""
        out = np.empty((len(indices), self.shape[1]), self.dtype)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        for k in np.unique(which):
            chosen = which == k
            out[chosen] = self.blocks[k][indices[chosen] - self.starts[k]]
        return out

    def joined(self) -> np.ndarray:
        """The blocks as one array in this thread's scratch buffer (`layer_buffer`),
        valid until its next call."""
        return np.concatenate(self.blocks, out=layer_buffer(self.shape, self.dtype))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = self.joined()
        return joined if dtype is None else joined.astype(dtype)
