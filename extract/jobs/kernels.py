"""Which kernel implementations a target's forward runs, and the rule for the slow ones.

On a GPU, hybrid linear-attention targets (Qwen3.5 / 3.6) need `fla` (chunked gated
delta rule) and `causal-conv1d`; without them transformers falls back to its PyTorch
reference, many times slower. The store's fingerprint records what ran; a CUDA
worker on the fallback is warned about loudly, and refused with
``--require-fast-kernels`` before it loads a single weight."""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING

FAST_KERNELS_EXTRA = 'pip install -e ".[gpu]"  (flash-linear-attention, causal-conv1d)'


if TYPE_CHECKING:
    import torch

# Functions transformers wraps with `use_kernel_func_from_hub_with_fallback`, as run
# by a cache-less (prefill) forward: hub-kernel name -> (report key, package name).
_PREFILL_KERNELS = {
    "chunk_gated_delta_rule": ("linear_attention", {"fla": "fla"}),
    "causal_conv1d_fn": ("causal_conv1d", {"causal_conv1d": "causal-conv1d"}),
}


def kernel_report(model: torch.nn.Module) -> dict:
    """Which implementations this model's forward uses, for the store's fingerprint:
    ``{"attention": "sdpa", "linear_attention": "fla"|"torch"|None,
    "causal_conv1d": "causal-conv1d"|"torch"|None}`` (None: the model has no such layers).

    transformers picks, once at import of the modeling module, the optional package's
    function if it imports and its own PyTorch reference otherwise, and keeps the choice
    in the wrapper's closure; we read that choice rather than guess it. (Hub kernels via
    ``use_kernels=True``/``kernelize`` would override it; `load_target` never asks for them.)
    """
    report = {"attention": getattr(model.config, "_attn_implementation", None)}
    report.update(_prefill_kernels({type(m).__module__ for m in model.modules()}))
    return report


def kernels_of_class(model_class) -> dict:
    """The prefill kernels a model class will run, known before any weight is loaded."""
    return _prefill_kernels({model_class.__module__})


def _prefill_kernels(module_names) -> dict:
    report: dict[str, str | None] = {key: None for key, _ in _PREFILL_KERNELS.values()}
    for _, names in fallback_wrappers(module_names):
        if names["func_name"] in _PREFILL_KERNELS:
            key, packages = _PREFILL_KERNELS[names["func_name"]]
            chosen = "torch" if names["implementation"] is names["torch_function"] else names["package"]
            report[key] = packages.get(chosen, chosen)
    return report


def fallback_wrappers(module_names) -> list[tuple]:
    """(wrapper, its closure's values: `func_name`, `implementation`, `torch_function`,
    `package`, ...) of each function `use_kernel_func_from_hub_with_fallback` wrapped
    among the names of the modules `module_names` (torch's own left out)."""
    modules = [sys.modules[n] for n in sorted(module_names) if n in sys.modules and not n.startswith("torch")]
    found = []
    for module in modules:
        for function in vars(module).values():
            wrapper = fallback_wrapper(function)
            if wrapper is not None:
                found.append((wrapper, closure_values(wrapper)))
    return found


def kernel_implementations(function) -> tuple | None:
    """(the implementation transformers chose, its PyTorch reference) behind a function
    wrapped by `use_kernel_func_from_hub_with_fallback` (the same function twice when
    the package is missing), else None: what `benchmarks/gpu_check.py` compares."""
    wrapper = fallback_wrapper(function)
    if wrapper is None:
        return None
    names = closure_values(wrapper)
    return names["implementation"], names["torch_function"]


def fallback_wrapper(function):
    """The function `use_kernel_func_from_hub_with_fallback` made around `function`'s
    PyTorch reference (its closure holds the choice), else None."""
    while function is not None:
        if not inspect.isfunction(function):
            # transformers >= 5.25 with the `kernels` package: the module-level name is
            # kernels' `Func` module, whose class's forward calls the wrapper as `func`
            function = closure_values(getattr(type(function), "forward", None)).get("func")
            continue
        if {"func_name", "implementation", "torch_function", "package"} <= closure_values(function).keys():
            return function
        function = getattr(function, "__wrapped__", None)
    return None


def closure_values(function) -> dict:
    try:
        return dict(inspect.getclosurevars(function).nonlocals)
    except (TypeError, ValueError):
        return {}


def fallback_kernels(kernels: dict) -> list[str]:
    """The prefill kernels of `kernels` (a `kernel_report`) running the PyTorch fallback."""
    return sorted(key for key, _ in _PREFILL_KERNELS.values() if kernels.get(key) == "torch")


def slow_kernels_message(kernels: dict, where: str) -> str:
    slow = fallback_kernels(kernels)
    if slow == ["causal_conv1d"]:
        return (
            f"{where} runs the PyTorch fallback for causal_conv1d on CUDA (causal-conv1d not importable; it "
            "has no binary wheel on PyPI): it costs little beside the linear attention -- "
            f"{FAST_KERNELS_EXTRA} builds it from source"
        )
    return (
        f"{where} runs the PyTorch fallback for {', '.join(slow)} on CUDA (fla / causal-conv1d not importable): "
        f"extraction will be many times slower -- {FAST_KERNELS_EXTRA}"
    )


def check_fast_kernels(kernels: dict, device_type: str, where: str) -> None:
    """Refuse a CUDA target whose linear attention is the fallback (`--require-fast-kernels`).
    causal-conv1d's fallback alone is only warned about (`slow_kernels_message`): the package
    has no binary wheel, and its fallback is a short convolution, cheap beside the layer."""
    if device_type == "cuda" and kernels.get("linear_attention") == "torch":
        raise RuntimeError(slow_kernels_message(kernels, where) + "; refused by --require-fast-kernels")
