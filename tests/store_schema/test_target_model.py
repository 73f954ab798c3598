"""The one target loader (`store_schema.runtime.target_model`): its dtype and device
rule, partial loads, and the refusal of a checkpoint that does not fill the model,
through every caller (extraction and generation workers' `load_target`, `speculate`,
`verify --recompute`)."""

from __future__ import annotations

import shutil

import builders
import pytest
import torch
from safetensors.torch import load_file, save_file

from extract.jobs.target import load_target
from store_schema.__main__ import main as store_cli
from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.target_model import TargetWeightsError, compute_dtype, device_map_for, load_target_model
from train.cli import main as train_cli
from train.export.drafter_dir import export_drafter
from train.families.dflash.model import DFlashDrafter, DrafterConfig


def test_the_dtype_and_device_rule():
    assert compute_dtype("cpu") == torch.float32 and compute_dtype(torch.device("meta")) == torch.float32
    assert compute_dtype("cuda") == torch.bfloat16 and compute_dtype("cuda:3") == torch.bfloat16
    assert compute_dtype("cuda", on_cuda=torch.float16) == torch.float16
    assert compute_dtype("cpu", on_cuda=torch.float16) == torch.float32  # a config's train.dtype is for CUDA only
    assert device_map_for(torch.device("cpu")) is None
    assert device_map_for(torch.device("cuda", 1)) == {"": "cuda:1"}
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        device_map_for(torch.device("cuda"))  # transformers would pick the GPU from LOCAL_RANK


def test_a_partial_load_keeps_the_first_layers_and_no_head(qwen3_5_dir):
    whole = load_target_model(qwen3_5_dir)
    part = load_target_model(qwen3_5_dir, keep_layers=3)
    assert (whole.architecture, part.architecture) == ("Qwen3_5ForCausalLM", "Qwen3_5TextModel")
    assert whole.num_layers == part.num_layers == 8 and len(part.model.layers) == 3
    assert part.model.get_output_embeddings() is None and part.dtype == torch.float32
    assert not part.model.training and not any(p.requires_grad for p in part.model.parameters())
    for name, tensor in part.model.state_dict().items():
        assert torch.equal(tensor, whole.model.model.state_dict()[name]), name
    with pytest.raises(ValueError, match="keep_layers must be in 1..8"):
        load_target_model(qwen3_5_dir, keep_layers=9)


def _without(source, tmp_path, drop=(), add=None):
    """A copy of model directory `source` with tensors dropped from (or added to) its weights."""
    target = tmp_path / "target"
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_missing_and_unexpected_weights_are_refused_with_their_names(qwen3_dir, tmp_path):
    late = _without(qwen3_dir, tmp_path / "late", drop=["model.layers.5.mlp.up_proj.weight"])
    with pytest.raises(TargetWeightsError, match=r"missing \['model.layers.5.mlp.up_proj.weight'\]"):
        load_target_model(late)
    assert len(load_target_model(late, keep_layers=5).model.layers) == 5  # a layer left out may be absent

    extra = {"model.layers.0.mlp.gate.weight": torch.zeros(4, 4)}
    stray = _without(qwen3_dir, tmp_path / "stray", add=extra)
    for keep in (None, 3):
        with pytest.raises(TargetWeightsError, match=r"unexpected \['.*layers.0.mlp.gate.weight'\]"):
            load_target_model(stray, keep_layers=keep)


def test_every_caller_refuses_a_missing_weight(qwen3_dir, tmp_path, capsys):
    """Extraction and generation workers (`load_target`, whole or in part), `speculate`
    and `verify --recompute` (which used to load with no check and compare random weights)."""
    broken = _without(qwen3_dir, tmp_path, drop=["model.layers.1.self_attn.q_proj.weight"])
    for keep in (None, 3):
        with pytest.raises(TargetWeightsError, match="q_proj.weight"):
            load_target(broken, keep_layers=keep)

    config = DrafterConfig.from_target(
        read_target_config(qwen3_dir),
        mask_token_id=5,
        context_layer_ids=[1, 3],
        block_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        architecture="dflash",
    )
    export = export_drafter(DFlashDrafter(config), tmp_path / "drafter", dtype=torch.float32)
    prompts = builders.write_chat_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3, 4]}])
    assert train_cli(["speculate", "--drafter", str(export), "--target", str(broken), "--prompts", str(prompts)]) == 1
    assert "missing ['model.layers.1.self_attn.q_proj.weight']" in capsys.readouterr().err

    store = tmp_path / "store"
    builders.random_store(store, num_shards=1, num_target_layers=6, vocab_size=512)
    assert store_cli(["verify", str(store), "--recompute", "1", "--model", str(broken)]) == 1
    assert "missing ['model.layers.1.self_attn.q_proj.weight']" in capsys.readouterr().err
