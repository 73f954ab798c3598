"""Export to z-lab's DFlash directory format and back: config fields, tensor names
(no target tensors), identical outputs after reload, a Qwen3 config transformers reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from train.export import export_drafter, load_drafter
from train.model import DFlashDrafter, DrafterConfig
from store_schema.target_config import read_target_config
from train.target_head import load_target_head


@pytest.fixture(scope="module")
def trained(qwen3_dir):
    """A drafter for the tiny Qwen3 target, with non-default weights everywhere."""
    target = read_target_config(qwen3_dir)
    config = DrafterConfig.from_target(target, mask_token_id=3, context_layer_ids=[1, 3], num_layers=2, block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter, load_target_head(qwen3_dir)


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

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.1.mlp.down_proj.weight", "layers.1.self_attn.k_norm.weight"} <= names
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


def test_round_trip_gives_identical_logits(tmp_path, trained):
    drafter, head = trained
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
