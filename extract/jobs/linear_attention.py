"""Which linear-attention kernel a hybrid target runs: the package transformers found
(fla), checked against PyTorch's reference before it computes a stored state, or the
reference itself (`extract run --linear-attention torch`).

An installed fla can be broken (a Triton or driver mismatch, a GPU it was not built
for) and still run without an error: its states would be stored as if they were the
target's. So a worker first runs one layer's chunked gated delta rule both ways on
random inputs of the target's own shape; below `AGREEMENT` (cosine of the outputs) it
switches to the reference and says so. The switch is transformers' own choice, made
once per process when the modeling module is imported and kept in its wrapper's
closure (`kernels.fallback_wrappers`): it is set there, so `kernel_report` (the store's
fingerprint) reads "torch" afterwards, and it holds for every model of that module in
the process (an extraction worker loads one)."""

from __future__ import annotations

import inspect

import torch

from .kernels import closure_values, fallback_wrappers
from .settings import check_linear_attention

AGREEMENT = 0.999  # cosine of the package's output with the reference's (bf16 rounding: > 0.9999)
KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")  # transformers' hub names
CHECK_TOKENS = 128  # two of the reference's 64-token chunks


def choose_linear_attention(model: torch.nn.Module, choice: str = "auto") -> str | None:
    """Make `model`'s linear attention run as `choice` says; a line saying what changed
    and why, or None (no linear attention, the reference already, or a package that
    agrees with it)."""
    check_linear_attention(choice)
    wrappers = _package_wrappers(model)
    if not wrappers:
        return None
    package = closure_values(next(iter(wrappers.values())))["package"]
    if choice == "torch":
        use_reference(wrappers.values())
        return f"linear attention: PyTorch's reference instead of {package}, as --linear-attention torch asks"
    if "chunk_gated_delta_rule" not in wrappers:  # a prefill's kernel is the reference already
        return None
    names = closure_values(wrappers["chunk_gated_delta_rule"])
    config = getattr(model.config, "text_config", model.config)
    parameter = next(model.parameters())
    cosine = agreement(names["implementation"], names["torch_function"], config, parameter.device, parameter.dtype)
    if cosine >= AGREEMENT:
        return None
    use_reference(wrappers.values())
    return (
        f"linear attention: {package}'s chunk_gated_delta_rule disagrees with PyTorch's reference on random inputs "
        f"of this target's shape (cosine {cosine:.4f} < {AGREEMENT}); this process runs the reference instead"
    )


def agreement(implementation, reference, config, device: torch.device, dtype: torch.dtype) -> float:
    """Cosine of `implementation`'s output with `reference`'s on one layer's random inputs
    (queries and keys repeated to the value heads, as transformers' layer hands them)."""
    generator = torch.Generator().manual_seed(0)
    heads, key_dim, value_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim

    def normal(*shape):
        return torch.randn(1, CHECK_TOKENS, *shape, generator=generator).to(device, dtype)

    query, key, value = normal(heads, key_dim), normal(heads, key_dim), normal(heads, value_dim)
    g = -torch.nn.functional.softplus(normal(heads).float()).to(dtype)  # log decays, < 0
    beta = torch.sigmoid(normal(heads).float()).to(dtype)
    settings = dict(g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        got, want = (_call(fn, query, key, value, settings).float().flatten() for fn in (implementation, reference))
    return float(torch.nn.functional.cosine_similarity(got, want, dim=0))


def use_reference(wrappers) -> None:
    """Point each transformers wrapper at its PyTorch reference, as it does itself where
    the package is missing."""
    for wrapper in wrappers:
        reference = closure_values(wrapper)["torch_function"]
        _set_nonlocal(wrapper, "implementation", reference)
        _set_nonlocal(wrapper, "is_new_implementation", False)
        _set_nonlocal(wrapper, "supported_devices", None)
        _set_nonlocal(wrapper, "applicable_params", tuple(inspect.signature(reference).parameters))


def _package_wrappers(model: torch.nn.Module) -> dict:
    """Hub name -> transformers' wrapper, for the linear-attention kernels `model`'s
    modules run through a package rather than the reference."""
    return {
        names["func_name"]: wrapper
        for wrapper, names in fallback_wrappers({type(m).__module__ for m in model.modules()})
        if names["func_name"] in KERNELS and names["implementation"] is not names["torch_function"]
    }


def _call(function, query, key, value, settings: dict) -> torch.Tensor:
    accepted = inspect.signature(function).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    output = function(query, key, value, **{k: v for k, v in settings.items() if takes_any or k in accepted})
    return output[0] if isinstance(output, tuple) else output


def _set_nonlocal(function, name: str, value) -> None:
    function.__closure__[function.__code__.co_freevars.index(name)].cell_contents = value
