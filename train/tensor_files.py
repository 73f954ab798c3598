"""Tensors on disk, without pickle: safetensors files that any user may read.
Checkpoints (`train.fitting.checkpoint`) and exported drafters
(`train.export.drafter_dir`) both write through here."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from store_schema.runtime.target_weights import header_problem

_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust I/O errors carry errno


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, with the file's mode from the umask like any other
    file this process writes: safetensors writes 0600, which a server running as
    another user cannot read. An I/O failure is raised as the OSError it was (so a
    full disk reads as one), not as safetensors' own error type."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:
        found = _OS_ERROR.search(str(error))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from error
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


class DamagedTensorFile(ValueError):
    """A safetensors file that cannot be read whole: one line naming it, what is wrong and
    the fix (a partial download, a copy cut short, a disk that filled)."""


# What to do about a damaged file, by the file it is (drafter export or checkpoint).
DRAFTER_FIX = "download the drafter again, or export it again from its run (python -m train export)"
CHECKPOINT_FIX = "this checkpoint is damaged: delete it to resume from the one before, or start the run again"


def read_tensors(path: str | Path, fix: str = DRAFTER_FIX) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, by name; a file whose header is unreadable or
    whose size falls short of what its header places is `DamagedTensorFile` (checked by
    `store_schema.runtime.target_weights.header_problem`, the rule the target's files
    are held to), before safetensors reads it."""
    problem = header_problem(Path(path)) if Path(path).is_file() else ""
    if problem:
        raise DamagedTensorFile(f"{path} {problem}; {fix}")
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
