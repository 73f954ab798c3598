"""Tensors on disk, without pickle: safetensors files that any user may read.
Checkpoints (`train.fitting.checkpoint`) and exported drafters
(`train.export.drafter_dir`) both write through here."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the file's mode from the umask like any other
    file this process writes: safetensors writes 0600, which a server running as
    another user cannot read."""
    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, by name."""
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
