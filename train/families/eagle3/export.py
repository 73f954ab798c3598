"""EAGLE-3's export: the `LlamaForCausalLMEagle3` directory vLLM (`llama_eagle3.py`),
SGLang and SpecForge load, and back.

config.json is a Llama config (`model_type: "llama"`, one hidden layer) with
`draft_vocab_size` and `eagle_config: {eagle_aux_hidden_state_layer_ids,
use_aux_hidden_state}`; model.safetensors holds `fc`, `midlayer.*`, `norm`,
`lm_head` [draft vocab, H], `d2t` (offsets: target id = draft id + d2t[draft id])
and `t2d` (the target ids drafted), never the target's `embed_tokens` (the engines
share the target's).

Layer ids: this project's id L is the output of decoder layer L. vLLM's aux id j is
the residual entering layer j, i.e. the output of layer j - 1, and it takes the ids
as written: so the export writes L + 1 (`engine_aux_ids`). SGLang adds 1 again to
explicit ids: for SGLang pass the layers on its command line as this project's ids
(docs/acceptance-and-serving.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from train.dtypes import name_of
from train.families.eagle3.config import ARCHITECTURE, Eagle3Config
from train.families.eagle3.model import Eagle3Drafter
from train.tensor_files import read_tensors, save_tensors

EXPORTED_CLASS = "LlamaForCausalLMEagle3"
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
NOT_EXPORTED = ("rotary_emb.",)  # rebuilt from the config


def engine_aux_ids(layer_ids: list[int]) -> list[int]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` of this project's layer ids (L -> L + 1)."""
    return [layer + 1 for layer in layer_ids]


def project_layer_ids(aux_ids: list[int]) -> list[int]:
    """This project's layer ids of vLLM's aux ids (j -> j - 1)."""
    return [layer - 1 for layer in aux_ids]


def config_json(config: Eagle3Config, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> dict:
    rope_parameters = {"rope_type": "default", **config.rope_parameters, "rope_theta": config.rope_theta}
    return {
        "architectures": [EXPORTED_CLASS],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "initializer_range": config.initializer_range,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "num_target_layers": config.num_target_layers,
        "ttt_steps": config.ttt_steps,
        "eagle_config": {AUX_IDS_KEY: engine_aux_ids(config.context_layer_ids), "use_aux_hidden_state": True},
        "torch_dtype": name_of(dtype),
        **(extra or {}),
    }


def export_drafter(drafter: Eagle3Drafter, out_dir: Path, dtype: torch.dtype, extra_config: dict) -> Path:
    """`config.json` and `model.safetensors` into `out_dir` (weights in `dtype`; d2t / t2d as they are)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in drafter.state_dict().items():
        if not name.startswith(NOT_EXPORTED):
            state[name] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
    save_tensors(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_json(drafter.config, dtype, extra_config), indent=2) + "\n")
    return out_dir


def read_drafter_config(model_dir: Path) -> Eagle3Config:
    """The drafter config of an EAGLE-3 export's config.json (this project's or
    SpecForge's); ValueError naming the file and the field it lacks."""
    path = Path(model_dir) / "config.json"
    data = json.loads(path.read_text())
    aux = (data.get("eagle_config") or {}).get(AUX_IDS_KEY)
    missing = [
        key for key in ("hidden_size", "num_attention_heads", "vocab_size", "num_target_layers") if key not in data
    ]
    if missing or not aux:
        absent = missing + ([] if aux else [f"eagle_config.{AUX_IDS_KEY}"])
        raise ValueError(f"{path}: an EAGLE-3 config needs {', '.join(absent)}")
    heads = data["num_attention_heads"]
    return Eagle3Config(
        hidden_size=data["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads", heads),
        head_dim=data.get("head_dim") or data["hidden_size"] // heads,
        intermediate_size=data["intermediate_size"],
        vocab_size=data["vocab_size"],
        draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"],
        num_target_layers=data["num_target_layers"],
        context_layer_ids=project_layer_ids(aux),
        ttt_steps=data.get("ttt_steps", 7),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta", 1e6),
        max_position_embeddings=data.get("max_position_embeddings", 40960),
        attention_bias=data.get("attention_bias", False),
        hidden_act=data.get("hidden_act", "silu"),
        architecture=ARCHITECTURE,
    )


def load_weights(drafter: Eagle3Drafter, model_dir: Path, keep_dtype: bool = False) -> Eagle3Drafter:
    """A drafter directory's (export or checkpoint) `model.safetensors` into `drafter`
    (strict: every tensor present, nothing extra; KeyError naming them otherwise), cast
    to the drafter's dtype, or with `keep_dtype` the drafter cast to the stored one."""
    weights = Path(model_dir) / "model.safetensors"
    state = read_tensors(weights)
    if keep_dtype:
        drafter.to(next(tensor.dtype for tensor in state.values() if tensor.is_floating_point()))
    result = drafter.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if not name.startswith(NOT_EXPORTED)]
    if missing or result.unexpected_keys:
        raise KeyError(f"{weights}: missing tensors {missing}, unexpected tensors {result.unexpected_keys}")
    return drafter


def load_drafter(model_dir: Path, dtype: torch.dtype | None, device) -> Eagle3Drafter:
    """Rebuild an export's drafter (dtype None keeps the stored one)."""
    drafter = Eagle3Drafter(read_drafter_config(Path(model_dir)))
    return load_weights(drafter, model_dir, keep_dtype=dtype is None).to(device=device, dtype=dtype)
