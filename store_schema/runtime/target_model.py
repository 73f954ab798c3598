"""Loading a target model: the one loader extraction, generation, decoding and
`verify --recompute` all call, and the one rule for its device and dtype.

    loaded = load_target_model("/models/Qwen3.6-27B", "cuda:0")                 # whole causal LM
    loaded = load_target_model(path, "cuda:0", keep_layers=62)                 # layers 0..61, no head

What it guarantees, whoever calls it:

- the path is a model directory (`config.json`, one line naming it otherwise) and a
  CUDA device exists before anything is read;
- the compute dtype is `compute_dtype`: bf16 on CUDA (what the target is served in),
  fp32 elsewhere (the CPU path is the reference path: tests, `verify` re-running a few
  samples, where accuracy matters and throughput does not; CPU bf16 speed depends on
  the host). The store keeps bf16 either way;
- the weights go straight to one explicit device: ``device_map={"": "cuda:N"}``, never
  the bare ``"cuda"``, which transformers resolves through ``LOCAL_RANK`` (a process
  launched by torchrun would put its copy on another rank's GPU);
- no weight is left randomly initialised: a missing or shape-mismatched tensor, or one
  in the checkpoint that the model has no place for, is refused (`TargetWeightsError`,
  naming them), besides the tensors transformers itself ignores (multi-token-prediction
  heads, a multimodal release's vision tower) and, for a partial load, the layers and
  head left out on purpose;
- only the language model: a vision tower that still got built is refused;
- eval mode, gradients off, trust_remote_code off unless asked.

``keep_layers=K`` builds the headless text model (e.g. ``Qwen3_5TextModel``) with its
config cut to K decoder layers: what capturing layers ``< K`` needs (on Qwen3.6-27B with
context layers up to 61 that leaves out layers 62-63 and the 2.5 GB head). A multimodal
release keeps the language model under ``model.language_model.*``; transformers maps that
onto the text-only causal LM itself, and for the headless class `_TEXT_MODEL_KEYS` does."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:  # the loader imports transformers only where a target is loaded
    from transformers import PreTrainedModel

from .startup import collector_paused
from .target_config import read_config_json
from .target_weights import TargetWeightsError


def compute_dtype(device: torch.device | str, on_cuda: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype a target (or a training step) computes in on `device`: `on_cuda`
    (bf16 unless a config says otherwise) on CUDA, fp32 on every other device."""
    return on_cuda if torch.device(device).type == "cuda" else torch.float32


def device_map_for(device: torch.device) -> dict | None:
    """transformers' `device_map` for one explicit device: None on CPU (weights load
    there), ``{"": "cuda:N"}`` on CUDA; a CUDA device without its index is refused, as
    transformers would resolve it through LOCAL_RANK."""
    if device.type == "cpu":
        return None
    if device.index is None:
        raise ValueError(f"device {device} has no index: pass cuda:N (the bare 'cuda' follows LOCAL_RANK)")
    return {"": str(device)}


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` with its index: 'cuda' becomes this process's current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' requested but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class LoadedTarget:
    """A loaded target: the module, where and how it computes, and what it was loaded from."""

    model: PreTrainedModel  # a *ForCausalLM, or its headless text model with `keep_layers`
    path: str
    device: torch.device
    dtype: torch.dtype
    num_layers: int  # the checkpoint's decoder layers (not only the loaded ones)
    checkpoint_architectures: list[str] = field(default_factory=list)  # from config.json

    @property
    def architecture(self) -> str:
        return type(self.model).__name__


@collector_paused()  # the model's classes and modules live as long as the process
def load_target_model(
    model_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    *,
    keep_layers: int | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    check_class: Callable[[type], None] | None = None,
) -> LoadedTarget:
    """Load the target's language model (see the module docstring for the rules).
    `check_class` is called with the class about to be built, before any weight is
    read (extraction refuses slow kernels there)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # transformers only where a target is loaded

    path = Path(model_path)
    checkpoint = read_config_json(path)  # a directory that is not a model: one line naming it, not a hub lookup
    device = resolve_device(device)
    dtype = dtype or compute_dtype(device)
    text = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code).get_text_config()
    num_layers = int(text.num_hidden_layers)
    options = dict(
        dtype=dtype,
        device_map=device_map_for(device),
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
        output_loading_info=True,
    )
    model_class = _headless_class(text) if keep_layers is not None else None
    if check_class is not None and model_class is not None:
        check_class(model_class)
    if model_class is None:
        model, loading = cast(tuple, AutoModelForCausalLM.from_pretrained(str(path), **options))
    else:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the left-out layers and head are "unexpected" on purpose
        try:
            model, loading = model_class.from_pretrained(
                str(path),
                config=_cut_to_layers(text, num_layers if keep_layers is None else keep_layers),
                key_mapping=_TEXT_MODEL_KEYS,
                **options,
            )
        finally:
            hf_logging.set_verbosity(verbosity)
    check_loading(loading, type(model).__name__, path, keep_layers if model_class is not None else None)
    vision = [name for name, _ in model.named_parameters() if _is_vision(name)]
    if vision:
        raise TargetWeightsError(
            f"{path}: {type(model).__name__} holds vision-tower parameters ({vision[:3]} ...); this "
            "transformers version does not map the multimodal checkpoint onto its text-only causal LM"
        )
    model.eval()
    model.requires_grad_(False)
    return LoadedTarget(model, str(path), device, dtype, num_layers, list(checkpoint.get("architectures") or []))


def check_loading(loading: dict, architecture: str, path, keep_layers: int | None = None) -> None:
    """The one refusal: weights missing or of the wrong shape (they would be randomly
    initialised), or checkpoint tensors with no place in the model, except those a
    partial load of `keep_layers` layers leaves out on purpose and a vision tower's."""
    missing = sorted(loading.get("missing_keys") or [])
    mismatched = sorted(str(key) for key in loading.get("mismatched_keys") or [])
    unexpected = sorted(key for key in loading.get("unexpected_keys") or [] if not _left_out(key, keep_layers))
    if missing or mismatched or unexpected:
        found = [
            f"{what} {keys[:8]}"
            for what, keys in (("missing", missing), ("of the wrong shape", mismatched), ("unexpected", unexpected))
            if keys
        ]
        raise TargetWeightsError(
            f"{path}: loading {architecture}, checkpoint tensors {'; '.join(found)}: missing or mismatched weights "
            "would be randomly initialised, unexpected ones mean the checkpoint is not this architecture"
        )


# The text model's own weights are `model.*` in a causal-LM checkpoint (the headless
# class drops the `model.` prefix itself); a multimodal release has them under
# `model.language_model.*`.
_TEXT_MODEL_KEYS = {r"^model\.language_model\.": "model."}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_VISION_PARTS = ("visual", "vision_tower", "vision_model")


def _left_out(key: str, keep_layers: int | None) -> bool:
    """A checkpoint tensor a load may leave out: a vision tower's, and with `keep_layers`
    the head and the decoder layers from `keep_layers` on."""
    if _is_vision(key):
        return True
    if keep_layers is None:
        return False
    layer = _LAYER_INDEX.search(key)
    return (
        key.startswith("lm_head.")
        or key.startswith("mtp.")
        or (layer is not None and int(layer.group(1)) >= keep_layers)
    )


def _is_vision(name: str) -> bool:
    return any(part in _VISION_PARTS for part in name.split("."))


def _headless_class(text_config):
    """The headless text model class for this config (e.g. Qwen3_5TextModel), or None
    for one transformers does not know (remote code): then the whole model loads."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING  # transformers only where a target is loaded

    try:
        return MODEL_MAPPING[type(text_config)]
    except KeyError:
        return None


def _cut_to_layers(text_config, keep: int):
    config = copy.deepcopy(text_config)
    if not 1 <= keep <= config.num_hidden_layers:
        raise ValueError(f"keep_layers must be in 1..{config.num_hidden_layers}, got {keep}")
    config.num_hidden_layers = keep
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:keep]
    return config


def headless_on_meta(text_config, keep_layers: int):
    """The headless model `load_target_model(keep_layers=...)` builds, on torch's meta
    device (no weights read, nothing allocated): what `extract plan --dry-run` sizes."""
    model_class = _headless_class(text_config)
    if model_class is None:
        raise ValueError(f"transformers has no text model class for {type(text_config).__name__}")
    with torch.device("meta"):
        return model_class(_cut_to_layers(text_config, keep_layers))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers, in order (``model.model.layers`` for Llama-style LMs): where
    extraction and decoding hook the layers they capture."""
    decoder: torch.nn.Module = model.get_decoder()  # type: ignore[operator]
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    num_layers = getattr(model.config, "num_hidden_layers", None)
    lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if len(lists) != 1:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return lists[0]
