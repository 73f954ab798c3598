"""Dtype names: one table for every command and config key.

Both spellings are accepted everywhere (`bf16` / `bfloat16`, `fp16` / `float16`,
`fp32` / `float32`): `train.dtype`, `train export --dtype`, `train eval --dtype`.
What is printed or written (logs, config.json, command output) is always the long
name, torch's own. Names resolve without importing torch, so a parser can check
them before any heavy import."""

from __future__ import annotations

NAMES = ("bfloat16", "float16", "float32")
_SHORT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def dtype_name(text: str) -> str:
    """The long name of `text` (either spelling); ValueError naming what is accepted."""
    name = _SHORT.get(text, text)
    if name not in NAMES:
        accepted = ", ".join(f"{long} ({short})" for short, long in _SHORT.items())
        raise ValueError(f"unknown dtype {text!r}; use one of {accepted}")
    return name


def torch_dtype(text: str):
    """The torch dtype of `text` (either spelling)."""
    import torch  # here, not at the top: train.cli reads dtype names for `--help`, which loads no torch

    return getattr(torch, dtype_name(text))


def name_of(dtype) -> str:
    """The long name of a torch dtype (`torch.bfloat16` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")
