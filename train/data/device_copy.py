"""Host-to-GPU copies that overlap the training step.

A sample's features leave the loader as views into a decoded shard in pageable
memory; `.to("cuda", non_blocking=True)` from pageable memory is synchronous
(CUDA stages it through a bounce buffer), ~157 MB per 3072-token sequence at
5 x 5120 bf16. `DeviceCopier` stages them through pinned memory (torch's caching
host allocator, reused once a copy is done) and copies on its own stream from the
loader's delivery thread; the consumer makes its stream wait for that copy only
when it uses the sample (`wait`).

A new thread's current CUDA device is 0, and leaving `torch.cuda.stream()` restores
the thread's current device: on a rank whose GPU is not 0 that creates a CUDA context
on GPU 0 (~0.5 GB, per rank). So the first call on each thread sets the thread's
device first, as PyTorch's pin-memory thread does (`torch.cuda.set_device`)."""

from __future__ import annotations

import threading

import torch


class DeviceCopier:
    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"DeviceCopier copies to a CUDA device, not {device}")
        # the index now, on the constructing thread: a bare "cuda" on another thread means GPU 0
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)
        self._thread = threading.local()

    def __call__(self, sample):
        """Start copying `sample.features` (and fp8 `scales`) to the device; the sample
        then holds the device tensors and `ready`, the event that marks the copy done."""
        if not getattr(self._thread, "bound", False):
            torch.cuda.set_device(self.device)
            self._thread.bound = True
        with torch.cuda.stream(self.stream):
            sample.features = [self._copy(t) for t in sample.features]
            sample.scales = [self._copy(t) for t in sample.scales]
            ready = torch.cuda.Event()
            ready.record(self.stream)
        sample.ready = ready
        return sample

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        # pin_memory() copies the view into page-locked memory; the async copy records an
        # event with the host allocator, so the pinned block is reused only once it is done
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def wait(ready, tensors) -> None:
        """Make the current stream wait for the copy, and tell the allocator the copied
        tensors are used there (they were allocated on the copy stream)."""
        stream = torch.cuda.current_stream(tensors[0].device) if tensors else torch.cuda.current_stream()
        stream.wait_event(ready)
        for tensor in tensors:
            tensor.record_stream(stream)
