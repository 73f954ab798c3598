"""The serving engines' config rules, reimplemented as small pure functions (each
citing the engine's file and function), read on this project's exports: every
layer's kind, causality and window as vLLM and SGLang would read the export equal
what the trainer used, for the published Qwen3.6-27B layout and the demo's.

Windows are compared as W = "a key is visible when query - key < W": transformers'
and vLLM's `sliding_window` (vLLM's kernels keep W - 1 keys to the left), and
SGLang's `window_left` + 1. Both engines load the drafter's config.json through
transformers' Qwen3Config, which keeps `sliding_window` only when
`use_sliding_window` is true (transformers/models/qwen3/configuration_qwen3.py).

The export traps these rules expose are refused at export
(`train.families.dflash.export.check_serving_traps`), tested at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from store_schema.runtime.target_config import TargetConfig
from train.export.drafter_dir import export_drafter, read_drafter_config
from train.families.dflash.export import drafter_config_json
from train.families.dflash.model import DFlashDrafter, DrafterConfig


@dataclass(frozen=True)
class Layer:
    kind: str
    causal: bool
    window: int | None  # W: visible when query - key < W; None = no window


def transformers_window(data: dict) -> int | None:
    """Qwen3Config.__post_init__: `sliding_window if use_sliding_window else None`."""
    return data.get("sliding_window") if data.get("use_sliding_window", False) else None


# -- vLLM: vllm/model_executor/models/qwen3_dflash.py ---------------------------------------
def vllm_causal(data: dict, i: int) -> bool:
    """`_dflash_layer_causal`: top-level is_causal, else dflash_config.causal, else
    causal exactly for sliding layers."""
    if data.get("is_causal") is not None:
        return bool(data["is_causal"])
    override = (data.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    layer_types = data.get("layer_types")
    return bool(layer_types) and layer_types[i] == "sliding_attention"


def vllm_layer(data: dict, i: int, v2_runner: bool) -> Layer:
    """`_resolve_layer_attention`: mixed sliding/full layouts need the V2 model
    runner; `dflash_config.use_swa` forces sliding; the window is
    dflash_config.swa_window_size, else the (transformers-read) sliding_window, and a
    sliding layer without one raises."""
    dflash = data.get("dflash_config") or {}
    layer_types = data.get("layer_types")
    use_swa = dflash.get("use_swa", False)
    any_sliding = False
    if layer_types is not None:
        sliding = sum(kind == "sliding_attention" for kind in layer_types)
        any_sliding = sliding > 0
        if 0 < sliding < len(layer_types) and not v2_runner:
            raise NotImplementedError("mixed sliding/full attention requires the V2 model runner")
    is_sliding = (
        use_swa if layer_types is None or (use_swa and not any_sliding) else layer_types[i] == "sliding_attention"
    )
    window = None
    if is_sliding:
        window = dflash.get("swa_window_size", transformers_window(data))
        if window is None:
            raise ValueError("DFlash sliding attention requires a window size")
    return Layer("sliding_attention" if is_sliding else "full_attention", vllm_causal(data, i), window)


def vllm_context_hidden_states(data: dict) -> list[int]:
    """vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py,
    `get_eagle3_aux_layers_from_config`: eagle_aux_hidden_state_layer_ids as they
    are, else dflash_config.target_layer_ids + 1; an aux id k is the hidden state
    entering decoder layer k (transformers' hidden_states[k])."""
    ids = data.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [i + 1 for i in data["dflash_config"]["target_layer_ids"]]


# -- SGLang: python/sglang/srt/models/dflash.py, speculative/dflash_utils.py -----------------
def sglang_layer(data: dict, i: int) -> Layer:
    """models/dflash.py `_get_dflash_layer_attention_params`: full_attention is
    ENCODER_ONLY (bidirectional), sliding_attention is DECODER (causal) with
    dflash_utils.py `get_dflash_attention_sliding_window_size` = sliding_window - 1
    (window_left; raises without a window), unless `_get_dflash_attention_type`
    finds an explicit top-level `is_causal` (SGLang with DFlash 2): then DECODER
    when true, ENCODER_ONLY when false, every layer; a non-causal window is
    symmetric (flashattention_backend: `(window_left, window_left)`). No
    layer_types: all bidirectional. `dflash_config.causal` is never read."""
    layer_types = data.get("layer_types")
    explicit = data.get("is_causal")
    if layer_types is None:
        return Layer("full_attention", False, None)
    if layer_types[i] == "full_attention":
        return Layer("full_attention", bool(explicit), None)
    if layer_types[i] != "sliding_attention":
        raise ValueError(f"unsupported layer type {layer_types[i]!r}")
    window = transformers_window(data)
    if window is None:
        raise ValueError("DFLASH sliding_attention layers require config.sliding_window")
    window_left = int(window) - 1
    return Layer("sliding_attention", True if explicit is None else bool(explicit), window_left + 1)


def trainer_layers(config: DrafterConfig) -> list[Layer]:
    """What the trainer ran: `DrafterConfig.layer_attention`, the one owner of the rule."""
    return [
        Layer(kind, config.layer_attention(i).causal, config.layer_attention(i).window)
        for i, kind in enumerate(config.layer_types)
    ]


# -- the layouts ------------------------------------------------------------------------------
QWEN36_27B = TargetConfig(
    hidden_size=5120,
    vocab_size=248320,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    intermediate_size=17408,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
)
DEMO_TARGET = TargetConfig(
    hidden_size=256,
    vocab_size=2048,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    intermediate_size=512,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def published_drafter() -> DrafterConfig:
    return DrafterConfig.from_target(
        QWEN36_27B, mask_token_id=248070, context_layer_ids=[1, 16, 31, 46, 61], architecture="dflash"
    )


def demo_drafter() -> DrafterConfig:
    """scripts/demo.py: `model.num_hidden_layers=1` over the default 3 context layers."""
    return DrafterConfig.from_target(
        DEMO_TARGET, mask_token_id=2047, num_context_layers=3, num_hidden_layers=1, architecture="dflash"
    )


LAYOUTS = {"qwen3.6-27b": published_drafter, "demo": demo_drafter}


def test_the_layouts_are_the_published_and_the_demo_ones():
    published, demo = published_drafter(), demo_drafter()
    assert published.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert (
        published.sliding_window,
        published.num_attention_heads,
        published.head_dim,
        published.num_key_value_heads,
    ) == (2048, 32, 128, 8)
    assert demo.layer_types == ["full_attention"] and demo.context_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engines_read_every_layer_as_the_trainer_ran_it(layout):
    config = LAYOUTS[layout]()
    data = drafter_config_json(config)
    read_back = read_drafter_config_from(data)
    trained = trainer_layers(config)
    assert trainer_layers(read_back) == trained  # this project's own reader
    mixed = len(set(config.layer_types)) > 1
    if mixed:
        with pytest.raises(NotImplementedError, match="V2 model runner"):
            vllm_layer(data, 0, v2_runner=False)
    assert [vllm_layer(data, i, v2_runner=True) for i in range(config.num_hidden_layers)] == trained
    assert [sglang_layer(data, i) for i in range(config.num_hidden_layers)] == trained
    assert [k - 1 for k in vllm_context_hidden_states(data)] == config.context_layer_ids
    assert data["num_target_layers"] == config.num_target_layers and data["block_size"] == 16


def test_is_causal_is_read_by_vllm_from_either_field_and_by_sglang():
    """A non-causal sliding layer (is_causal false, the published DFlash 2's) is served
    as trained by vLLM (it reads is_causal, older versions dflash_config.causal, and
    the export writes both) and by SGLang (`_get_dflash_attention_type` lets an explicit
    is_causal win); an SGLang without that function runs sliding layers causal."""
    config = DrafterConfig.from_target(
        DEMO_TARGET,
        mask_token_id=2047,
        num_context_layers=3,
        layer_types=["sliding_attention"] * 2,
        sliding_window=64,
        is_causal=False,
        architecture="dflash",
    )
    data = drafter_config_json(config)
    trained = trainer_layers(config)
    assert data["is_causal"] is False and data["dflash_config"]["causal"] is False
    assert [vllm_layer(data, i, v2_runner=False) for i in range(2)] == trained
    older_vllm = {k: v for k, v in data.items() if k != "is_causal"}  # reads only dflash_config.causal
    assert [vllm_layer(older_vllm, i, v2_runner=False) for i in range(2)] == trained
    assert [sglang_layer(data, i) for i in range(2)] == trained
    older_sglang = {k: v for k, v in data.items() if k != "is_causal"}  # before _get_dflash_attention_type
    assert all(layer.causal for layer in (sglang_layer(older_sglang, i) for i in range(2)))


def read_drafter_config_from(data: dict) -> DrafterConfig:
    """`read_drafter_config` on a config.json dict (it reads a directory)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(data))
        return read_drafter_config(folder)


# -- the traps, refused at export ------------------------------------------------------------
def tiny(**overrides) -> DFlashDrafter:
    fields = dict(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=64,
        num_target_layers=4,
        context_layer_ids=[1],
        mask_token_id=3,
        num_hidden_layers=1,
        block_size=4,
        layer_types=["sliding_attention"],
        sliding_window=8,
        architecture="dflash",
    )
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(**{**fields, **overrides}))


@pytest.mark.parametrize(
    "drafter_overrides,extra,field",
    [
        ({"sliding_window": None}, None, "sliding_window"),
        ({}, {"use_sliding_window": False}, "sliding_window"),
        ({}, {"eagle_aux_hidden_state_layer_ids": [2]}, "eagle_aux_hidden_state_layer_ids"),
        ({}, {"is_causal": False}, "is_causal"),
        ({"is_causal": False}, {"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1]}}, "is_causal"),
    ],
    ids=[
        "sliding-without-window",
        "window-switched-off",
        "eagle-aux-ids",
        "is_causal-alone",
        "is_causal-without-dflash-causal",
    ],
)
def test_export_refuses_a_config_an_engine_reads_otherwise(tmp_path, drafter_overrides, extra, field):
    out = tmp_path / "export"
    with pytest.raises(ValueError, match=field) as info:
        export_drafter(tiny(**drafter_overrides), out, extra_config=extra)
    assert "\n" not in str(info.value) and not out.exists()  # one line; nothing written


def test_export_writes_is_causal_twice_and_never_the_eagle_ids(tmp_path):
    out = export_drafter(tiny(is_causal=False), tmp_path / "export")
    data = json.loads((out / "config.json").read_text())
    assert data["is_causal"] is False and data["dflash_config"]["causal"] is False
    assert "eagle_aux_hidden_state_layer_ids" not in json.dumps(data)
    assert read_drafter_config(out).is_causal is False
    plain = json.loads((export_drafter(tiny(), tmp_path / "plain") / "config.json").read_text())
    assert "is_causal" not in plain and "causal" not in plain["dflash_config"]
