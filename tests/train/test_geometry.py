"""Drafter geometry: the published defaults from a target (Qwen3.6-27B's and a tiny
one's), `model.*` keys validated naming the key, the renamed `model.num_layers`,
and `--resume` refusing a config that builds another drafter than the checkpoint's."""

from __future__ import annotations

import json

import builders
import pytest
import tiny
import yaml

from store_schema.runtime.target_config import TargetConfig, read_target_config
from train.config_error import ConfigError
from train.config_loading import load_config
from train.families.dflash.anchors import LayerAttention
from train.families.dflash.export import drafter_config_json
from train.families.dflash.model import DrafterConfig, default_kv_heads
from train.fitting import checkpoint as ckpt
from train.fitting.trainer import Trainer

QWEN36_27B = TargetConfig(  # the text fields of Qwen3.6-27B's config.json
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
SLIDING, FULL = "sliding_attention", "full_attention"


def test_defaults_for_qwen36_27b_are_the_published_drafter():
    """SpecForge configs/qwen3.6-27b-dflash.json / z-lab/Qwen3.6-27B-DFlash: 5 layers,
    32 x 128 heads, 8 KV heads, intermediate 17408, [sliding x4, full], window 2048."""
    config = DrafterConfig.from_target(QWEN36_27B, mask_token_id=248070, architecture="dflash")
    assert config.context_layer_ids == [1, 16, 31, 46, 61]
    data = drafter_config_json(config)
    expected = {
        "hidden_size": 5120,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
        "layer_types": [SLIDING] * 4 + [FULL],
        "sliding_window": 2048,
        "use_sliding_window": True,
        "max_window_layers": 5,
        "num_target_layers": 64,
        "vocab_size": 248320,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    }
    assert {key: data[key] for key in expected} == expected
    assert [config.layer_attention(i) for i in (0, 4)] == [LayerAttention(True, 2048), LayerAttention(False, None)]


def test_defaults_for_a_tiny_target(qwen3_dir):
    """Hidden 64 < head_dim 128: one head of 128, one KV head; the rest as published."""
    target = read_target_config(qwen3_dir)
    config = DrafterConfig.from_target(target, mask_token_id=3, context_layer_ids=[1, 3], architecture="dflash")
    assert (config.num_attention_heads, config.head_dim, config.num_key_value_heads) == (1, 128, 1)
    assert config.intermediate_size == target.intermediate_size and config.hidden_size == 64
    assert config.layer_types == [SLIDING] * 4 + [FULL] and config.sliding_window == 2048


@pytest.mark.parametrize(
    "heads,kv", [(1, 1), (2, 2), (6, 6), (8, 8), (10, 5), (12, 6), (24, 8), (32, 8), (40, 8), (7, 7), (11, 1)]
)
def test_default_kv_heads_is_the_largest_divisor_up_to_8(heads, kv):
    assert default_kv_heads(heads) == kv


def test_overrides_and_what_follows_from_them():
    config = DrafterConfig.from_target(
        QWEN36_27B, mask_token_id=0, num_hidden_layers=3, num_attention_heads=12, architecture="dflash"
    )
    assert config.layer_types == [SLIDING, SLIDING, FULL] and config.num_key_value_heads == 6
    config = DrafterConfig.from_target(
        QWEN36_27B,
        mask_token_id=0,
        layer_types=[FULL, FULL],
        head_dim=256,
        sliding_window=None,
        intermediate_size=None,
        architecture="dflash",
    )
    assert (config.num_hidden_layers, config.num_attention_heads, config.sliding_window) == (2, 20, None)
    assert (
        DrafterConfig.from_target(QWEN36_27B, mask_token_id=0, head_dim=64, architecture="dflash").num_attention_heads
        == 32
    )  # capped
    assert config.intermediate_size == 17408  # None takes the default
    assert DrafterConfig.from_target(
        QWEN36_27B, mask_token_id=0, num_hidden_layers=1, architecture="dflash"
    ).layer_types == [FULL]


def run_config(*sets, **explicit):
    return load_config(None, list(sets), store="s", target="t", out="o", **explicit)


@pytest.mark.parametrize(
    "setting,key",
    [
        ("model.num_hidden_layers=0", "model.num_hidden_layers"),
        ("model.head_dim=0", "model.head_dim"),
        ("model.sliding_window=0", "model.sliding_window"),
        ("model.intermediate_size=-1", "model.intermediate_size"),
        ("model.layer_types=[full_attention, linear_attention]", "model.layer_types"),
        ("model.layer_types=full_attention", "model.layer_types"),
        ("model.layer_types=[]", "model.layer_types"),
        ("model.attention=dense", "model.attention"),
    ],
)
def test_model_keys_are_validated_naming_the_key(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run_config(setting)


def test_layer_types_must_match_layers_and_kv_heads_divide_heads():
    with pytest.raises(ConfigError, match=r"model\.layer_types: has 2 entries, model\.num_hidden_layers is 3"):
        run_config("model.num_hidden_layers=3", "model.layer_types=[sliding_attention, full_attention]")
    with pytest.raises(ConfigError, match=r"model\.num_key_value_heads: must divide model\.num_attention_heads \(12\)"):
        run_config("model.num_attention_heads=12", "model.num_key_value_heads=5")


def test_geometry_keys_parse_and_reach_the_drafter_config():
    config = run_config(
        "model.layer_types=[sliding_attention, sliding_attention, full_attention]",
        "model.sliding_window=512",
        "num_attention_heads=16",
        "model.head_dim=64",
    )
    assert config.model.layer_types == [SLIDING, SLIDING, FULL]
    drafter = DrafterConfig.from_target(QWEN36_27B, mask_token_id=0, **config.model.geometry())
    assert (drafter.num_hidden_layers, drafter.num_attention_heads, drafter.head_dim) == (3, 16, 64)
    assert (drafter.num_key_value_heads, drafter.sliding_window) == (8, 512)


def test_every_drafter_shape_key_of_the_run_config_reaches_the_drafter_config():
    """`ModelConfig` repeats `DrafterConfig`'s shape fields (the run config validates
    without importing the model): `geometry()` hands over each field the two share
    (`causal` as `is_causal`; the mask token is resolved apart), and only fields
    `DrafterConfig` has, so a field added to one and not passed on fails here."""
    from dataclasses import fields

    from train.families.dflash.config import ModelConfig

    drafter_fields = {f.name for f in fields(DrafterConfig)}
    handed = ModelConfig().geometry()
    assert set(handed) <= drafter_fields, set(handed) - drafter_fields
    shared = {f.name for f in fields(ModelConfig)} & drafter_fields
    assert shared - {"mask_token_id"} <= set(handed), shared - set(handed)


def test_num_layers_is_read_as_num_hidden_layers(tmp_path):
    """The older key, e.g. in a run saved before the rename, still loads."""
    assert run_config("model.num_layers=2").model.num_hidden_layers == 2
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"model": {"num_layers": 3, "block_size": 8}}))
    assert load_config(path, store="s", target="t", out="o").model.num_hidden_layers == 3
    old = DrafterConfig.from_target(QWEN36_27B, mask_token_id=0, architecture="dflash").to_dict()
    old["num_layers"] = old.pop("num_hidden_layers")
    assert DrafterConfig.from_dict(old).num_hidden_layers == 5


TINY = tiny.drafter_sets(
    "model.num_hidden_layers=2",
    "eval.every=0",
    "train.checkpoint_every=1",
    "train.log_every=1",
    "data.heldout_fraction=0",
)


def test_resume_refuses_a_different_drafter(qwen3_dir, tmp_path):
    """A checkpoint written before sliding layers existed (all full attention, no
    layer_types) resumed under today's defaults would silently change every layer
    but the last to causal sliding: refused, naming the field."""
    builders.random_store(tmp_path / "s", num_shards=1, samples_per_shard=2, num_target_layers=6, layer_ids=(1, 3))
    config = load_config(
        None,
        TINY,
        store=str(tmp_path / "s"),
        target=str(qwen3_dir),
        out=str(tmp_path / "run"),
        **{"train.max_steps": 1},
    )
    Trainer.from_config(config, log=lambda m: None).fit()
    assert Trainer.from_config(config, resume=True, log=lambda m: None).step == 1  # same config: resumes

    changed = load_config(
        None,
        TINY + ["model.sliding_window=4"],
        store=str(tmp_path / "s"),
        target=str(qwen3_dir),
        out=str(tmp_path / "run"),
    )
    with pytest.raises(ConfigError, match=r"--resume: .* holds a different drafter: sliding_window: 4 vs 2048"):
        Trainer.from_config(changed, resume=True, log=lambda m: None)

    state_path = ckpt.latest_checkpoint(tmp_path / "run") / "state.json"
    state = json.loads(state_path.read_text())
    old = state["drafter_config"]
    old["num_layers"] = old.pop("num_hidden_layers")
    for key in ("layer_types", "sliding_window", "is_causal"):
        del old[key]
    state_path.write_text(json.dumps(state))
    with pytest.raises(
        ConfigError,
        match=r"layer_types: \['sliding_attention', 'full_attention'\] vs "
        r"\['full_attention', 'full_attention'\]",
    ):
        Trainer.from_config(config, resume=True, log=lambda m: None)
