"""Issue 45.1: the drafters the field publishes, as data. A fresh run on the 27B
family trains each kind's published layout (block, layer kinds, window, mask rule,
taps) wherever the config is silent, and says so; other targets keep the formulas;
`model.causal` trains, exports (`is_causal`) and loads in the reference with that mask."""

from __future__ import annotations

import json
import warnings

import builders
import pytest
import tiny
import torch
from dflash.model import DFlash2DraftModel
from reference_oracle import ANCHORS, BLOCK, inputs, load_reference, reference_logits

from extract.qwen3_6_27b import write_config_only_target
from store_schema.runtime.target_config import read_target_config
from train.config_loading import load_config
from train.export.drafter_dir import export_drafter
from train.families.dflash.config import ModelConfig
from train.families.dflash.published import fresh_drafter_config, published_layout
from train.fitting.trainer import Trainer
from train.target_head import load_target_head

SHAPE = dict(num_target_layers=6, hidden_size=64, vocab_size=512)  # the tiny Qwen3 target (qwen3_dir)


@pytest.fixture(scope="module")
def qwen3_6_27b(tmp_path_factory):
    return read_target_config(write_config_only_target(tmp_path_factory.mktemp("27b")))


def test_the_27b_family_trains_each_kinds_published_layout(qwen3_6_27b):
    lines = []
    dflash2 = fresh_drafter_config(qwen3_6_27b, 248_070, None, ModelConfig().geometry(), log=lines.append)
    assert (dflash2.architecture, dflash2.block_size, dflash2.is_causal) == ("dflash2", 8, False)
    assert dflash2.layer_types == ["sliding_attention"] * 5 and dflash2.sliding_window == 2048
    assert dflash2.context_layer_ids == [5, 19, 33, 47, 61]
    assert "configs/qwen3.6-27b-dflash2.json @5943b2f" in lines[0] and "non-causal" in lines[0]

    dflash = fresh_drafter_config(qwen3_6_27b, 248_070, None, ModelConfig(architecture="dflash").geometry())
    assert (dflash.block_size, dflash.is_causal, dflash.context_layer_ids) == (16, None, [1, 16, 31, 46, 61])
    assert dflash.layer_types == ["sliding_attention"] * 4 + ["full_attention"]

    # A store without the layout's taps is refused in one line saying how to get them (issue
    # 62.1); model.target_layer_ids trains on the store's layers; what the config sets wins.
    with pytest.raises(ValueError, match=r"not the published dflash2 taps .* lacks \[5, 19, 33, 47\].*--for-drafter"):
        fresh_drafter_config(qwen3_6_27b, 248_070, [1, 16, 31, 46, 61], ModelConfig().geometry())
    lines.clear()
    own = fresh_drafter_config(
        qwen3_6_27b,
        248_070,
        [1, 16, 31, 46, 61],
        ModelConfig(block_size=16, num_hidden_layers=3, causal=True).geometry(),
        log=lines.append,
        chosen_layer_ids=[1, 16, 31, 46, 61],
    )
    assert own.context_layer_ids == [1, 16, 31, 46, 61] and "model.target_layer_ids [1, 16, 31, 46, 61]" in lines[0]
    assert (own.block_size, own.is_causal, own.num_hidden_layers) == (16, True, 3)
    assert own.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]  # the formula


def test_the_27b_walkthrough_extracts_the_layers_its_default_drafter_trains_on(tmp_path, capsys):
    """Issue 62.1: `extract plan` on the 27B family without --layers keeps the default
    drafter's (DFlash 2's) published taps and says which drafters the store serves;
    --for-drafter dflash2,dflash keeps the union; a target without published drafters
    keeps the spread; --for-drafter there is refused by name."""
    from extract.__main__ import main
    from store_schema.published_taps import taps_for

    target = read_target_config(write_config_only_target(tmp_path / "27b"))
    assert taps_for(target, None)[0] == [5, 19, 33, 47, 61]
    assert taps_for(target, ["dflash2", "dflash"])[0] == [1, 5, 16, 19, 31, 33, 46, 47, 61]
    layers, line = taps_for(target, None)
    assert "dflash2 [5, 19, 33, 47, 61]; not dflash [1, 16, 31, 46, 61]" in line and "keeps all: 9 layers" in line
    with pytest.raises(ValueError, match="published kinds are dflash2, dflash"):
        taps_for(target, ["eagle3"])

    model = tmp_path / "27b"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}) + "\n"
    )
    argv = ["plan", "--model", str(model), "--corpus", str(corpus), "--dry-run", "--json"]
    assert main(argv) == 1  # a config-only target has no tokenizer to plan with; its layers come first
    err = capsys.readouterr().err
    assert "layers [5, 19, 33, 47, 61]: the published layouts of" in err and "pass --tokenizer DIR" in err
    assert main([*argv, "--for-drafter", "dflash2,dflash"]) == 1
    assert "layers [1, 5, 16, 19, 31, 33, 46, 47, 61]" in capsys.readouterr().err


def test_other_targets_keep_the_formulas(qwen3_dir):
    target = read_target_config(qwen3_dir)
    assert published_layout("dflash2", target) is None
    lines = []
    config = fresh_drafter_config(target, 3, [1, 3], ModelConfig().geometry(), log=lines.append)
    assert not lines and (config.block_size, config.is_causal) == (16, None)
    assert config.layer_types == ["sliding_attention"] * 4 + ["full_attention"]


def test_model_causal_trains_exports_and_loads_in_the_reference_with_that_mask(qwen3_dir, tmp_path):
    """The published DFlash 2's mask rule on the tiny target: sliding layers that see
    their whole block (non-causal), trained, exported as `is_causal: false`, and the
    same logits in `dflash` 0.1.0's DFlash2DraftModel."""
    store, _ = builders.random_store(
        tmp_path / "store", num_shards=2, samples_per_shard=3, target_dir=qwen3_dir, **SHAPE
    )
    sets = tiny.drafter_sets(
        "model.causal=false",
        "model.layer_types=[sliding_attention,sliding_attention]",
        f"model.block_size={BLOCK}",
        "model.sliding_window=6",
        "train.grad_accumulation=1",
        "eval.every=0",
        "data.heldout_fraction=0.0",
        "train.checkpoint_every=0",
        heads=True,
    )
    sets = [s for s in sets if not s.startswith("model.num_hidden_layers")]
    config = load_config(
        None, sets, store=str(store.path), target=str(qwen3_dir), out=str(tmp_path / "run"), **{"train.max_steps": 3}
    )
    trainer = Trainer.from_config(config, log=lambda line: None)
    trainer.fit()
    drafter = trainer.drafter.eval()
    assert drafter.config.is_causal is False
    assert [drafter.config.layer_attention(i).causal for i in range(2)] == [False, False]

    out = export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    exported = json.loads((out / "config.json").read_text())
    assert exported["is_causal"] is False and exported["dflash_config"]["causal"] is False
    reference = load_reference(out, DFlash2DraftModel)
    assert all(layer.self_attn.is_causal is False for layer in reference.layers)
    head = load_target_head(qwen3_dir)
    features, input_ids = inputs()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex without torch.compile warns on CPU
        expected = torch.stack([reference_logits(reference, head, features, input_ids, a) for a in ANCHORS])
        ours = head.lm_head(drafter(features, input_ids, torch.tensor(ANCHORS), head.embed_tokens, attention="split"))
    assert (ours - expected).abs().max() < 1e-4
