"""The target a worker holds: its language model loaded through the one loader
(`store_schema.runtime.target_model.load_target_model`: device and dtype rule,
refusal of missing or unexpected weights and of vision towers, partial loads), plus
the kernel report the store's fingerprint records, the ``--require-fast-kernels``
rule and the linear-attention kernel's check (`linear_attention`). Extraction
(`extract.extraction.runner`) and generation workers both hold one."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from store_schema.runtime.target_model import load_target_model

from .kernels import check_fast_kernels, kernel_report, kernels_of_class
from .linear_attention import choose_linear_attention

if TYPE_CHECKING:  # transformers comes with the loaded target
    from transformers import PreTrainedModel


@dataclass
class Target:
    """A loaded target model and the facts about it the store's fingerprint needs."""

    model: PreTrainedModel  # the *ForCausalLM (or its base model: `keep_layers`), eval mode, requires_grad off
    path: str
    device: torch.device
    dtype: torch.dtype  # compute dtype; the store keeps bf16 regardless
    num_layers: int  # decoder layers N (valid context layer ids are 0 .. N-2)
    hidden_size: int
    vocab_size: int
    architecture: str  # class actually loaded, e.g. "Qwen3_5ForCausalLM" or "Qwen3_5TextModel"
    checkpoint_architectures: list[str] = field(default_factory=list)  # from config.json
    kernels: dict = field(default_factory=dict)  # see `kernel_report`


def load_target(
    model_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    keep_layers: int | None = None,
    require_fast_kernels: bool = False,
    linear_attention: str = "auto",
) -> Target:
    """Load the target's language model through the one loader
    (`store_schema.runtime.target_model.load_target_model`: device and dtype rule,
    refusal of missing or unexpected weights and of vision towers, partial loads).

    ``keep_layers=K`` loads decoder layers ``0..K-1`` and no ``lm_head``: what
    capturing layers ``< K`` needs. ``num_layers`` stays the checkpoint's count.

    ``require_fast_kernels``: on CUDA, refuse (RuntimeError) a target whose linear
    attention or causal conv1d would run the PyTorch fallback, before loading it.

    ``linear_attention``: "auto" checks the package's kernel against PyTorch's reference
    and keeps it where they agree; "torch" runs the reference (`linear_attention`). What
    changed and why is printed to stderr, a line (a Ray worker's reaches the driver)."""
    where = f"{model_path}"
    loaded = load_target_model(
        model_path,
        device,
        dtype,
        keep_layers=keep_layers,
        trust_remote_code=trust_remote_code,
        check_class=(lambda cls: check_fast_kernels(kernels_of_class(cls), torch.device(device).type, where))
        if require_fast_kernels
        else None,
    )
    model = loaded.model
    switched = choose_linear_attention(model, linear_attention)
    if switched:
        print(f"{where}: {switched}", file=sys.stderr, flush=True)
    kernels = kernel_report(model)
    if require_fast_kernels:
        check_fast_kernels(kernels, loaded.device.type, where)
    head = model.get_output_embeddings()
    rows = cast(torch.Tensor, (head if head is not None else model.get_input_embeddings()).weight).shape[0]
    return Target(
        model=model,
        path=loaded.path,
        device=loaded.device,
        dtype=loaded.dtype,
        num_layers=loaded.num_layers,
        hidden_size=int(model.config.hidden_size),
        vocab_size=int(rows),
        architecture=loaded.architecture,
        checkpoint_architectures=loaded.checkpoint_architectures,
        kernels=kernels,
    )
