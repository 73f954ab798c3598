"""`fit --init-from DIR`: a z-lab-format drafter with sliding layers, saved by the
reference package (`dflash` 0.1.0), starts a run with its own shape, weights and
mask token, fine-tunes for a few steps, exports, and reloads in the reference
package with the fine-tuned weights; the run records where it started; a
resumed run no longer needs the directory; drafters that do not fit the store,
the target or the config are refused naming the field."""

from __future__ import annotations

import json
import shutil

import builders
import pytest
import tiny
import torch
from dflash.model import DFlash2DraftModel, DFlashDraftModel

from store_schema import file_sha256
from train.cli import main
from train.config_error import ConfigError
from train.config_loading import load_config
from train.families.dflash.dflash2 import DFlash2Drafter
from train.fitting.checkpoint import Checkpointer, list_checkpoints, read_state
from train.fitting.trainer import Trainer

BLOCK = 8
RUN = [
    "model.architecture=dflash",
    "model.block_size=8",
    "model.num_anchors=16",
    "train.grad_accumulation=1",
    "eval.every=0",
    "data.heldout_fraction=0.2",
    "train.log_every=1",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Random states of the tiny Qwen3 target's layers 1, 2 and 3 (the drafter reads 1 and 3)."""
    path = tmp_path_factory.mktemp("init") / "store"
    builders.random_store(path, num_shards=2, samples_per_shard=6, layer_ids=(1, 2, 3), num_target_layers=6)
    return path


@pytest.fixture(scope="module")
def zlab_dir(tmp_path_factory):
    """A published drafter directory as the reference package writes it: two
    sliding layers (window 6) then full attention, a shape unlike the trainer's
    defaults (4 heads x 16, 2 KV heads, intermediate 96), mask token 5, layers
    [1, 3] of the 6-layer target (`builders.save_reference_drafter`)."""
    path = tmp_path_factory.mktemp("zlab") / "drafter"
    builders.save_reference_drafter(path, BLOCK, seed=4)
    return path


def run_config(store, target, out, init_from, *sets):
    return load_config(
        None,
        RUN + list(sets),
        store=str(store),
        target=str(target),
        out=str(out),
        **{"model.init_from": str(init_from), "train.max_steps": 3},
    )


def test_fine_tunes_a_published_drafter_and_hands_it_back(store, zlab_dir, qwen3_dir, tmp_path):
    reference = DFlashDraftModel.from_pretrained(str(zlab_dir), dtype=torch.float32)
    published = {name: t.clone() for name, t in reference.state_dict().items()}
    messages = []
    trainer = Trainer.from_config(run_config(store, qwen3_dir, tmp_path / "run", zlab_dir), log=messages.append)
    config = trainer.drafter.config
    # Its shape, layers and mask token, not the trainer's defaults; its weights exactly.
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (config.sliding_window, config.intermediate_size, config.num_attention_heads) == (6, 96, 4)
    assert config.mask_token_id == 5 and trainer.run_info["mask_token_rule"] == "init_from"
    assert trainer.loader.layers == [1, 3]  # the store holds 1, 2, 3: only the drafter's are read
    assert all(torch.equal(t, published[name]) for name, t in trainer.drafter.state_dict().items())
    assert any("mask token id 5 (rule: init_from)" in m for m in messages)
    assert any("fine-tuning from" in m for m in messages)

    trainer.fit()
    assert trainer.step == 3
    tuned = {name: t.detach().clone() for name, t in trainer.drafter.state_dict().items()}
    assert any(not torch.equal(tuned[name], published[name]) for name in published)
    # Where it started is recorded in the config, the checkpoints and the export.
    started = {"path": str(zlab_dir.resolve()), "model_sha256": file_sha256(zlab_dir / "model.safetensors")}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["init_from"] == str(zlab_dir)
    assert read_state(list_checkpoints(tmp_path / "run")[-1])["run_info"]["init_from"] == started
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export"), "--dtype", "fp32"]) == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["init_from"] == started and exported["mask_token_rule"] == "init_from"
    assert exported["layer_types"] == config.layer_types and exported["sliding_window"] == 6

    again, info = DFlashDraftModel.from_pretrained(
        str(tmp_path / "export"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(t, tuned[name]) for name, t in again.state_dict().items())
    assert (
        main(
            [
                "eval",
                "--store",
                str(store),
                "--drafter",
                str(tmp_path / "export"),
                "--target",
                str(qwen3_dir),
                "--ddtree-budgets",
                "4",
                "--json",
            ]
        )
        == 0
    )


def test_a_resumed_fine_tuning_run_no_longer_needs_the_directory(store, zlab_dir, qwen3_dir, tmp_path):
    source = tmp_path / "published"
    shutil.copytree(zlab_dir, source)
    argv = [
        "fit",
        "--store",
        str(store),
        "--target",
        str(qwen3_dir),
        "--out",
        str(tmp_path / "run"),
        "--init-from",
        str(source),
        "--max-steps",
        "2",
        *tiny.cli_sets(RUN),
    ]
    assert main(argv) == 0
    shutil.rmtree(source)
    assert main(["fit", "--out", str(tmp_path / "run"), "--resume", "--max-steps", "4"]) == 0
    state = read_state(list_checkpoints(tmp_path / "run")[-1])
    assert state["step"] == 4 and state["run_info"]["init_from"]["path"] == str(source.resolve())
    assert state["drafter_config"]["intermediate_size"] == 96


def test_a_fit_reads_its_start_once(store, zlab_dir, qwen3_dir, tmp_path, monkeypatch):
    """Issue 46.5: the `--init-from` drafter's config, the resume point and the resumed
    checkpoint's state.json are each read once per fit."""
    from collections import Counter

    import train.families.dflash.export as dflash_export
    import train.fitting.build as build

    calls: Counter = Counter()

    def count(owner, name):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.update([name]) or original(*args, **kwargs))

    for owner, name in ((dflash_export, "read_drafter_config"), (Checkpointer, "resume_point"), (build, "read_state")):
        count(owner, name)
    argv = [
        "fit",
        "--store",
        str(store),
        "--target",
        str(qwen3_dir),
        "--out",
        str(tmp_path / "run"),
        "--init-from",
        str(zlab_dir),
        "--max-steps",
        "1",
        *tiny.cli_sets(RUN),
    ]
    assert main(argv) == 0
    assert calls == {"read_drafter_config": 1, "resume_point": 1}
    calls.clear()
    assert main(["fit", "--out", str(tmp_path / "run"), "--resume", "--max-steps", "2"]) == 0
    assert calls == {"resume_point": 1, "read_state": 1}


@pytest.mark.slow  # trains
@pytest.mark.parametrize("start", ["export", "run", "checkpoint"])
def test_a_dflash_drafter_warm_starts_a_dflash2_run(store, zlab_dir, qwen3_dir, tmp_path, start):
    """`--init-from` a DFlash drafter (an export, a run: its newest checkpoint, or a
    checkpoint) with `model.architecture=dflash2`: its backbone, identity
    convolutions and a zero successor codebook, so the run starts from exactly the
    DFlash drafter's logits; it trains and exports a DFlash 2 the reference loads; a
    DFlash run from that DFlash 2 export is refused."""
    source = zlab_dir
    if start != "export":
        dflash = Trainer.from_config(run_config(store, qwen3_dir, tmp_path / "dflash", zlab_dir), log=lambda m: None)
        dflash.fit()
        source = tmp_path / "dflash" if start == "run" else list_checkpoints(tmp_path / "dflash")[-1]
        backbone = {name: t.detach().clone() for name, t in dflash.drafter.state_dict().items()}
    else:
        backbone = DFlashDraftModel.from_pretrained(str(zlab_dir), dtype=torch.float32).state_dict()
    config = run_config(
        store,
        qwen3_dir,
        tmp_path / "run",
        source,
        "model.architecture=dflash2",
        "model.selector_rank=8",
        "model.selector_top_k=4",
    )
    trainer = Trainer.from_config(config, log=lambda m: None)
    drafter = trainer.drafter
    assert isinstance(drafter, DFlash2Drafter) and drafter.config.selector_rank == 8
    state = drafter.state_dict()
    assert all(torch.equal(state[name], t) for name, t in backbone.items())
    assert not drafter.candidate_selector.successor_codebook.any()
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert conv.base_kernel[:, 0].eq(1).all() and not conv.base_kernel[:, 1:].any()
            assert not conv.kernel_projection.weight.any()
    if start == "run":
        assert trainer.run_info["init_from"]["path"] == str(list_checkpoints(tmp_path / "dflash")[-1].resolve())
        return

    trainer.fit()
    assert trainer.step == 3 and drafter.layers[0].attention_conv.kernel_projection.weight.any()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export"), "--dtype", "fp32"]) == 0
    again, info = DFlash2DraftModel.from_pretrained(
        str(tmp_path / "export"), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dflash_config"]["selector_top_k"] == 4
    with pytest.raises(ConfigError, match="model.architecture: dflash, but --init-from .* is a dflash2 drafter"):
        Trainer.from_config(run_config(store, qwen3_dir, tmp_path / "back", tmp_path / "export"), log=lambda m: None)


def edited(zlab_dir, tmp_path, **changes):
    """A copy of the drafter directory with config.json fields changed."""
    path = tmp_path / "edited"
    shutil.copytree(zlab_dir, path)
    data = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key == "target_layer_ids":
            data["dflash_config"][key] = value
        else:
            data[key] = value
    (path / "config.json").write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes,sets,message",
    [
        ({}, ["model.block_size=16"], r"model.block_size: 16, but --init-from .* block_size 8"),
        ({"hidden_size": 32}, [], r"hidden_size 32, but the target and its store have 64"),
        ({"num_target_layers": 8}, [], r"num_target_layers 8, but the target and its store have 6"),
        ({"vocab_size": 1024}, [], r"vocab_size 1024, but the target and its store have 512"),
        (
            {"target_layer_ids": [1, 4]},
            [],
            r"dflash_config.target_layer_ids \[1, 4\] read layers \[4\] the store does not",
        ),
        ({}, ["model.num_attention_heads=8"], r"model.num_attention_heads: 8, but --init-from .* has 4"),
        ({}, ["model.layer_types=[full_attention, full_attention, full_attention]"], r"model.layer_types: .* has \["),
        ({}, ["model.sliding_window=2048"], r"model.sliding_window: 2048, but --init-from .* has 6"),
    ],
    ids=["block_size", "hidden_size", "num_target_layers", "vocab_size", "layer_ids", "heads", "layer_types", "window"],
)
def test_a_drafter_that_does_not_fit_is_refused_naming_the_field(
    store, zlab_dir, qwen3_dir, tmp_path, changes, sets, message
):
    source = edited(zlab_dir, tmp_path, **changes)
    config = run_config(store, qwen3_dir, tmp_path / "run", source, *sets)
    with pytest.raises(ConfigError, match=message):
        Trainer.from_config(config, log=lambda m: None)


def test_the_command_refuses_in_one_line(store, zlab_dir, qwen3_dir, tmp_path, capsys):
    argv = [
        "fit",
        "--store",
        str(store),
        "--target",
        str(qwen3_dir),
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--init-from",
    ]
    assert main(argv[:-1] + ["--set", "model.block_size=16", "--init-from", str(zlab_dir)]) == 1  # the drafter's is 8
    assert "model.block_size: 16" in capsys.readouterr().err
    assert main(argv + [str(tmp_path / "nothing")]) == 2  # not a drafter directory: usage
    assert "not a drafter directory" in capsys.readouterr().err
