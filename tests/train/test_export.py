"""Export to z-lab's DFlash directory format and back: config fields (sliding layers
included), tensor names (no target tensors), identical outputs after reload, a Qwen3
config transformers reads, refusals of what the drafter cannot run."""

from __future__ import annotations

import json

import builders
import pytest
import torch
from safetensors import safe_open

from store_schema.runtime.target_config import read_target_config
from train.export.drafter_dir import export_drafter, load_drafter, read_drafter_config
from train.families.dflash.anchors import LayerAttention
from train.families.dflash.dflash2 import DFlash2Drafter
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.target_head import load_target_head


def perturbed_drafter(qwen3_dir, **geometry):
    """A drafter for the tiny Qwen3 target, with non-default weights everywhere."""
    target = read_target_config(qwen3_dir)
    config = DrafterConfig.from_target(
        target, mask_token_id=3, context_layer_ids=[1, 3], block_size=8, **geometry, architecture="dflash"
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter, load_target_head(qwen3_dir)


@pytest.fixture(scope="module")
def trained(qwen3_dir):
    """Full attention everywhere, 4 heads x 16, 2 KV heads."""
    return perturbed_drafter(
        qwen3_dir,
        num_hidden_layers=2,
        layer_types=["full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


@pytest.fixture(scope="module")
def sliding(qwen3_dir):
    """The default geometry at 3 layers (sliding, sliding, full) with a window of 8."""
    return perturbed_drafter(qwen3_dir, num_hidden_layers=3, sliding_window=8)


def outputs(drafter, head):
    torch.manual_seed(1)
    features = torch.randn(40, 2 * 64)
    input_ids = torch.randint(0, 512, (40,))
    with torch.no_grad():
        hidden = drafter(features, input_ids, torch.tensor([0, 7, 19, 30]), head.embed_tokens)
        return head.lm_head(hidden.float())


def test_export_layout_and_config(tmp_path, trained):
    drafter, _ = trained
    out = export_drafter(drafter, tmp_path / "drafter", extra_config={"eos_token_id": 2})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3]}
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (64, 2, 4)
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (2, 16, 128)
    assert config["vocab_size"] == 512 and config["rope_theta"] == 10000.0 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == 2
    assert config["layer_types"] == ["full_attention", "full_attention"]
    assert (config["sliding_window"], config["use_sliding_window"], config["max_window_layers"]) == (None, False, 2)
    assert "is_causal" not in config

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "layers.1.self_attn.k_norm.weight",
    } <= names
    assert names == set(drafter.state_dict())
    assert not any("embed_tokens" in n or "lm_head" in n or "rotary" in n for n in names)


def test_transformers_reads_the_config_as_qwen3(tmp_path, trained):
    from transformers import AutoConfig

    out = export_drafter(trained[0], tmp_path / "drafter")
    config = AutoConfig.from_pretrained(str(out), trust_remote_code=False)
    assert type(config).__name__ == "Qwen3Config"
    assert config.num_hidden_layers == 2 and config.head_dim == 16 and config.num_key_value_heads == 2
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.dflash_config["target_layer_ids"] == [1, 3] and config.block_size == 8


def test_export_writes_sliding_layers_as_qwen3_reads_them(tmp_path, sliding):
    from transformers import AutoConfig

    out = export_drafter(sliding[0], tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (config["sliding_window"], config["use_sliding_window"], config["max_window_layers"]) == (8, True, 3)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (1, 1, 128)
    qwen3 = AutoConfig.from_pretrained(str(out))
    assert qwen3.layer_types == config["layer_types"] and qwen3.sliding_window == 8


@pytest.mark.parametrize("which", ["trained", "sliding"])
def test_round_trip_gives_identical_logits(tmp_path, which, request):
    drafter, head = request.getfixturevalue(which)
    exact = load_drafter(export_drafter(drafter, tmp_path / "fp32", dtype=torch.float32))
    assert exact.config == drafter.config
    assert torch.equal(outputs(exact, head), outputs(drafter, head))

    bf16 = load_drafter(export_drafter(drafter, tmp_path / "bf16"))
    assert bf16.fc.weight.dtype == torch.bfloat16 and bf16.rotary_emb.inv_freq.dtype == torch.float32
    reference = DFlashDrafter(drafter.config)
    reference.load_state_dict(drafter.state_dict())
    reference.to(torch.bfloat16)
    assert torch.equal(outputs(bf16, head), outputs(reference, head))


def test_load_refuses_incomplete_weights(tmp_path, trained):
    from safetensors.torch import save_file

    out = export_drafter(trained[0], tmp_path / "drafter")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "hidden_norm.weight"}
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(KeyError, match="hidden_norm.weight"):
        load_drafter(out)


def write_config(out, **changes):
    path = out / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():  # "dflash_config.name" changes a dflash_config entry
        section, _, name = key.rpartition(".")
        holder = config[section] if section else config
        if value is None:
            holder.pop(name, None)
        else:
            holder[name] = value
    path.write_text(json.dumps(config))


def test_reads_sliding_layers_the_way_qwen3config_does(tmp_path, sliding):
    """The window counts only with use_sliding_window; without layer_types, the
    layers from max_window_layers on are sliding (transformers' Qwen3Config rule)."""
    out = export_drafter(sliding[0], tmp_path / "drafter", dtype=torch.float32)
    write_config(out, use_sliding_window=False)
    config = read_drafter_config(out)
    assert config.sliding_window is None and config.layer_types[0] == "sliding_attention"
    assert config.layer_attention(0) == LayerAttention(causal=True, window=None)

    write_config(out, use_sliding_window=True, layer_types=None, max_window_layers=1)
    config = read_drafter_config(out)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config.layer_attention(1) == LayerAttention(causal=True, window=8)
    assert config.layer_attention(0) == LayerAttention(causal=False, window=None)

    write_config(out, layer_types=["full_attention"] * 3, is_causal=False)
    assert read_drafter_config(out).sliding_window is None  # no sliding layer: no window kept
    write_config(out, layer_types=["sliding_attention"] * 3, is_causal=False)
    config = read_drafter_config(out)
    assert config.is_causal is False and config.layer_attention(2) == LayerAttention(causal=False, window=8)
    reloaded = load_drafter(out)
    assert json.loads((export_drafter(reloaded, tmp_path / "again") / "config.json").read_text())["is_causal"] is False


@pytest.fixture(scope="module")
def dflash2(sliding):
    """The sliding drafter as a DFlash 2 (identity convolutions, zero successor codebook)."""
    return builders.warm_started(sliding[0], selector_rank=8, selector_top_k=4), sliding[1]


@pytest.mark.parametrize(
    "which,changes,message",
    [
        ("sliding", {"architectures": ["Eagle3DraftModel"]}, "architectures"),
        ("sliding", {"architectures": ["DFlashDraftModel", "DFlash2DraftModel"]}, "architectures"),
        ("sliding", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
        ("sliding", {"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ("sliding", {"output_multiplier": 2.0}, "output_multiplier=2.0"),
        ("sliding", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("sliding", {"num_key_value_heads": 3}, "num_key_value_heads 3"),
        # DFlash 2: its sizes must be in dflash_config (vLLM's qwen3_dflash2 reads them only there).
        ("sliding", {"architectures": ["DFlash2DraftModel"]}, "dflash_config lacks .'conv_kernel_size'"),
        (
            "dflash2",
            {"dflash_config.selector_rank": None, "selector_rank": 8},
            r"dflash_config lacks \['selector_rank'\]",
        ),
        ("dflash2", {"dflash_config.conv_group_size": 24}, "conv_group_size 24 must divide hidden_size 64"),
        ("dflash2", {"dflash_config.selector_top_k": 600}, "selector_top_k 600 exceeds the vocabulary"),
        ("dflash2", {"dflash_config.conv_kernel_size": 0}, "conv_kernel_size must be >= 1"),
        ("dflash2", {"dflash_config.output_multiplier": 2.0}, "output_multiplier=2.0"),
    ],
)
def test_read_refuses_what_the_drafter_cannot_run(tmp_path, request, which, changes, message):
    out = export_drafter(request.getfixturevalue(which)[0], tmp_path / "drafter")
    write_config(out, **changes)
    with pytest.raises((ValueError, KeyError), match=message) as info:
        load_drafter(out)
    assert "config.json" in str(info.value)


def test_dflash2_export_layout_and_round_trip(tmp_path, dflash2):
    drafter, head = dflash2
    out = export_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": 3,
        "target_layer_ids": [1, 3],
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    assert "no_rope_layers" not in config  # vLLM 0.34 routes a DFlash2DraftModel with it to another class
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.2.attention_conv.base_kernel",
        "layers.0.mlp_conv.kernel_projection.weight",
    } <= names
    assert names == set(drafter.state_dict())
    exact = load_drafter(out)
    assert isinstance(exact, DFlash2Drafter) and exact.config == drafter.config
    assert torch.equal(outputs(exact, head), outputs(drafter, head))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_follow_the_umask(tmp_path, trained, umask):
    """A server running as another user must be able to read an export: its files get
    the mode the umask gives any file (safetensors alone writes 0600)."""
    import os
    import stat

    previous = os.umask(umask)
    try:
        out = export_drafter(trained[0], tmp_path / "drafter")
    finally:
        os.umask(previous)
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name
