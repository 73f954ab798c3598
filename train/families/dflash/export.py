"""DFlash's export: the directory format DFlash inference code loads, and back.

The directory holds `config.json` and `model.safetensors`, as z-lab's published
drafters (e.g. z-lab/Qwen3-8B-DFlash-b16) do: a Qwen3 config
(`model_type: "qwen3"`, `num_hidden_layers` = drafter layers) with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and
`dflash_config: {mask_token_id, target_layer_ids}`. z-lab's `DFlashDraftModel`,
vLLM and SGLang read these fields. The weights carry z-lab's names and never the
target's `embed_tokens` / `lm_head`.

A DFlash 2 drafter (train/families/dflash/dflash2.py) is written in the reference's DFlash 2
layout: `architectures: ["DFlash2DraftModel"]` (vLLM: `qwen3_dflash2`) and
`dflash_config` also holding `block_size`, `conv_kernel_size`, `conv_group_size`,
`selector_rank` and `selector_top_k`; its convolutions and selector tensors under
the reference's names (the codebooks without a `.weight` suffix, as vLLM reads them).

`target_layer_ids` use z-lab's convention: id L is the output of decoder layer L
(transformers' hidden_states[L + 1]); the same convention as `context_layer_ids`.

What the serving engines would read differently from the trainer is refused at
export, one line naming the field (`check_serving_traps`): an `is_causal` that is
not also written as `dflash_config.causal` (older vLLM reads only that one), a
sliding layer without a window (vLLM and SGLang raise), and
`eagle_aux_hidden_state_layer_ids` (vLLM would take it over `target_layer_ids`,
without their +1). docs/acceptance-and-serving.md says which engines ignore
`is_causal` altogether.

What every export also records (the held-out split) is `train.export.drafter_dir`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.dtypes import name_of
from train.families.dflash.build import build_drafter
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.families.dflash.selector import CODEBOOKS
from train.families.dflash.variants import DFLASH, KINDS, kind_exported_as
from train.tensor_files import read_tensors, save_tensors


def drafter_config_json(config: DrafterConfig, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> dict:
    """The config.json dict for a drafter. Rope is written both ways: `rope_theta`
    (+ `rope_scaling: null`) for transformers 4 / vLLM / SGLang readers, and
    `rope_parameters` for transformers 5."""
    rope_parameters = {"rope_type": "default", **config.rope_parameters, "rope_theta": config.rope_theta}
    dflash_config: dict = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.context_layer_ids)}
    data: dict = {
        "architectures": [config.kind.exported_class],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": dflash_config,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        # Read as transformers' Qwen3Config and the reference do: `layer_types` per
        # layer, and the window only counts when `use_sliding_window` is true.
        "layer_types": list(config.layer_types or ()),
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "max_window_layers": config.num_hidden_layers,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": name_of(dtype),
    }
    if config.kind.sizes:  # the reference reads these from dflash_config
        dflash_config.update(
            {"block_size": config.block_size, **{name: getattr(config, name) for name in config.kind.sizes}}
        )
    if config.is_causal is not None:
        data["is_causal"] = config.is_causal
        dflash_config["causal"] = config.is_causal
    if config.rope_parameters.get("rope_type", "default") != "default":
        data["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    data.update(extra or {})
    return data


# vLLM reads it in place of dflash_config.target_layer_ids and without their +1
# (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config).
EAGLE_AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


def check_serving_traps(data: dict, where: str | Path) -> None:
    """Refuse a drafter config.json that vLLM or SGLang would read differently from
    how the trainer ran it (ValueError, one line naming the field)."""
    dflash = data.get("dflash_config") or {}
    if EAGLE_AUX_LAYERS_KEY in data or EAGLE_AUX_LAYERS_KEY in dflash:
        raise ValueError(
            f"{where}: {EAGLE_AUX_LAYERS_KEY} must not be written: vLLM would read it instead of "
            "dflash_config.target_layer_ids, without their +1 offset"
        )
    if data.get("is_causal") is not None and dflash.get("causal") != data["is_causal"]:
        raise ValueError(
            f"{where}: is_causal={data['is_causal']} must also be written as dflash_config.causal "
            f"(got {dflash.get('causal')!r}): older vLLM reads only that one"
        )
    sliding = [i for i, kind in enumerate(data.get("layer_types") or []) if kind == "sliding_attention"]
    window = data.get("sliding_window") if data.get("use_sliding_window") else None
    if sliding and window is None:
        raise ValueError(
            f"{where}: layers {sliding} are sliding_attention but sliding_window is unset (or "
            "use_sliding_window false): vLLM and SGLang refuse a sliding layer without a window"
        )


def export_drafter(
    drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None
) -> Path:
    """Write `config.json` and `model.safetensors` for `drafter` into `out_dir`.

    dtype: weights' dtype on disk (bf16, as published drafters are).
    extra_config: more top-level config keys (e.g. bos/eos token ids, provenance, the split)."""
    out_dir = Path(out_dir)
    config = drafter_config_json(drafter.config, dtype, extra_config)
    check_serving_traps(config, out_dir / "config.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in drafter.state_dict().items()}
    leaked = [name for name in state if "embed_tokens" in name or "lm_head" in name]
    if leaked:
        raise ValueError(f"drafter state dict carries target tensors {leaked}; they must stay out of the export")
    save_tensors(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


# Keys the reference applies (dflash_config first, then top level) that this drafter
# does not, with the values that make them no-ops.
UNSUPPORTED_DFLASH_KEYS = {
    "input_embedding_scale": (1.0,),
    "output_multiplier": (1.0,),
    "final_logit_softcapping": (None, 0, 0.0),
}


def checked_dflash_config(path: Path, data: dict) -> tuple[str, dict]:
    """The drafter kind of a config.json's `architectures` and its `dflash_config`,
    refused when either lacks what the drafter needs or asks for what it cannot do."""
    architectures = data.get("architectures") or [DFLASH.exported_class]
    kind = kind_exported_as(architectures[0]) if len(architectures) == 1 else None
    if kind is None:
        raise ValueError(
            f"{path}: architectures {architectures} not supported "
            f"({' or '.join(k.exported_class for k in KINDS.values())})"
        )
    dflash = data.get("dflash_config") or {}
    needed = ("mask_token_id", "target_layer_ids") + kind.sizes
    missing = [k for k in needed if k not in dflash]
    if missing:
        raise KeyError(f"{path}: dflash_config lacks {missing}")
    for key, neutral in UNSUPPORTED_DFLASH_KEYS.items():
        value = dflash.get(key, data.get(key, neutral[0]))
        if value not in neutral:
            raise ValueError(f"{path}: {key}={value!r} is not supported (only {neutral[0]!r})")
    return kind.name, dflash


def read_drafter_config(model_dir: str | Path) -> DrafterConfig:
    """DrafterConfig from an exported (or z-lab published) drafter's config.json.

    Sliding layers are read the way transformers' Qwen3Config (which the reference
    builds on) reads them: the window counts only with `use_sliding_window`, and
    without `layer_types` the layers from `max_window_layers` on are sliding."""
    path = Path(model_dir) / "config.json"
    data = json.loads(path.read_text())
    architecture, dflash = checked_dflash_config(path, data)
    block_size = dflash.get("block_size", data.get("block_size"))
    if block_size is None:
        raise KeyError(f"{path}: no block_size (top level or dflash_config)")
    rope_parameters = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    rope_theta = rope_parameters.pop("rope_theta", data.get("rope_theta", 10000.0))
    if rope_parameters.get("rope_type") == "default":
        rope_parameters.pop("rope_type")
    heads = data["num_attention_heads"]
    num_layers = data["num_hidden_layers"]
    window = data.get("sliding_window") if data.get("use_sliding_window", False) else None
    layer_types = data.get("layer_types") or [
        "sliding_attention" if window is not None and i >= data.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    try:
        return DrafterConfig(
            hidden_size=data["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            intermediate_size=data["intermediate_size"],
            vocab_size=data["vocab_size"],
            num_target_layers=data["num_target_layers"],
            context_layer_ids=list(dflash["target_layer_ids"]),
            mask_token_id=dflash["mask_token_id"],
            num_hidden_layers=num_layers,
            block_size=block_size,
            layer_types=layer_types,
            sliding_window=window,
            is_causal=data.get("is_causal"),
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=data.get("max_position_embeddings", 40960),
            attention_bias=data.get("attention_bias", False),
            hidden_act=data.get("hidden_act", "silu"),
            initializer_range=data.get("initializer_range", 0.02),
            rope_parameters=rope_parameters,
            architecture=architecture,
            **{name: dflash[name] for name in KINDS[architecture].sizes},
        )
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def load_drafter(
    model_dir: Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> DFlashDrafter:
    """Rebuild a DFlash (or DFlash 2) drafter from an exported or z-lab-format
    directory, sliding layers included (strict: every weight present, nothing
    extra). dtype None keeps the dtype stored on disk."""
    model_dir = Path(model_dir)
    drafter = build_drafter(read_drafter_config(model_dir))
    return load_weights(drafter, model_dir, keep_dtype=dtype is None).to(device=device, dtype=dtype)


def load_weights(
    drafter: DFlashDrafter, model_dir: str | Path, keep_dtype: bool = False, backbone_only: bool = False
) -> DFlashDrafter:
    """Copy a drafter directory's `model.safetensors` into `drafter` (strict: every
    weight present, nothing extra; KeyError naming them otherwise), cast to the
    drafter's dtype, or with `keep_dtype` the drafter cast to the stored one. The
    selector's codebooks are read under either name the reference loads
    (`candidate_selector.X`, or `candidate_selector.X.weight` as its save_pretrained writes).
    `backbone_only`: a DFlash 2 drafter takes a DFlash drafter's weights, its own
    modules keeping what they hold (the warm start, train/families/dflash/dflash2.py)."""
    weights = Path(model_dir) / "model.safetensors"
    spelled = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}" for name in CODEBOOKS}
    state = {spelled.get(name, name): tensor for name, tensor in read_tensors(weights).items()}
    if keep_dtype:
        drafter.to(next(iter(state.values())).dtype)
    result = drafter.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if not (backbone_only and drafter.kind.adds(name))]
    if missing or result.unexpected_keys:
        raise KeyError(f"{weights}: missing tensors {missing}, unexpected tensors {result.unexpected_keys}")
    return drafter
