"""The target's frozen embed_tokens / lm_head, read from safetensors alone, equal
what transformers loads, across the checkpoint layouts we meet."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from store_schema.runtime.target_config import read_target_config
from train.target_head import load_target_head


def test_qwen3_separate_lm_head(qwen3_dir):
    from transformers import AutoModelForCausalLM

    head = load_target_head(qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), trust_remote_code=False)
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert head.lm_head.weight.data_ptr() != head.embed_tokens.weight.data_ptr()
    assert not any(p.requires_grad for p in head.parameters())
    config = read_target_config(qwen3_dir)
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (64, 512, 6)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.intermediate_size == 128 and config.rope_theta == model.config.rope_parameters["rope_theta"]


def test_qwen3_5_multimodal_layout(qwen3_5_vl_dir):
    from transformers import Qwen3_5ForConditionalGeneration

    with safe_open(str(qwen3_5_vl_dir / "model.safetensors"), framework="pt") as f:
        assert "model.language_model.embed_tokens.weight" in f.keys()
    head = load_target_head(qwen3_5_vl_dir, dtype=torch.float32)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(qwen3_5_vl_dir))
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    config = read_target_config(qwen3_5_vl_dir)  # from the nested text_config
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers, config.head_dim) == (64, 512, 8, 16)


def test_qwen3_5_text_only(qwen3_5_dir):
    from transformers import AutoModelForCausalLM

    head = load_target_head(qwen3_5_dir)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_5_dir))
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)


def test_tied_embeddings_reuse_the_embedding(tmp_path):
    import builders
    from transformers import Qwen3ForCausalLM

    config = builders.qwen3_config(vocab_size=512, num_layers=2)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    head = load_target_head(tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(str(tmp_path))
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert head.lm_head.weight is head.embed_tokens.weight


def test_sharded_checkpoint_uses_the_index(tmp_path, qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_dir))
    model.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    head = load_target_head(tmp_path, dtype=torch.bfloat16)
    assert head.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(head.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_missing_tensor_names_the_file(tmp_path, qwen3_dir):
    shutil.copy(qwen3_dir / "config.json", tmp_path / "config.json")
    with safe_open(str(qwen3_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.safetensors.*lm_head"):
        load_target_head(tmp_path)

    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.safetensors.*embed"):
        load_target_head(tmp_path)

    (tmp_path / "model.safetensors").unlink()
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_target_head(tmp_path)
