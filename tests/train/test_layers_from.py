"""Issue 45.2-45.3: one store for several drafters' tap sets. `extract plan|run
--layers-from DIR,DIR` stores the union of the drafters' `target_layer_ids` (and the
dry run sizes each drafter's own set beside it); `fit`'s `model.target_layer_ids`
trains on any subset of the store's layers; a published-format DFlash 2 warm-starts
a run on a store holding its taps, and one lacking them is refused naming them."""

from __future__ import annotations

import json
import warnings

import builders
import pytest
import tiny
import torch
from dflash.model import DFlash2DraftModel
from reference_oracle import ANCHORS, inputs, load_reference, reference_logits

from extract.__main__ import main as extract_cli
from store_schema.runtime.target_config import read_target_config
from store_schema.stores import open_store
from train.cli import main as train_cli
from train.config_error import ConfigError
from train.config_loading import load_config
from train.export.drafter_dir import export_drafter
from train.families.dflash.build import build_drafter
from train.families.dflash.model import DrafterConfig
from train.fitting.trainer import Trainer
from train.target_head import load_target_head

SHAPE = dict(num_target_layers=6, hidden_size=64, vocab_size=512)  # the tiny Qwen3 target (qwen3_dir)
RUN = tiny.drafter_sets(
    "train.grad_accumulation=1", "eval.every=0", "data.heldout_fraction=0.0", "train.checkpoint_every=0", heads=True
)


def drafter_dir(qwen3_dir, path, layer_ids, architecture="dflash"):
    """An exported random drafter reading `layer_ids` of the tiny target."""
    config = DrafterConfig.from_target(
        read_target_config(qwen3_dir),
        mask_token_id=3,
        context_layer_ids=layer_ids,
        num_hidden_layers=1,
        architecture=architecture,
        block_size=8,
    )
    return export_drafter(build_drafter(config), path, dtype=torch.float32)


def test_plan_sizes_the_union_and_each_drafters_own_set(qwen3_dir, tmp_path, capsys):
    first, second = drafter_dir(qwen3_dir, tmp_path / "a", [1, 3]), drafter_dir(qwen3_dir, tmp_path / "b", [2, 3])
    corpus = builders.write_chat_jsonl(tmp_path / "corpus.jsonl", builders.coding_chats(6))
    argv = [
        "plan",
        "--dry-run",
        "--model",
        str(qwen3_dir),
        "--corpus",
        str(corpus),
        "--layers-from",
        f"{first},{second}",
    ]
    assert extract_cli([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["layer_ids"] == [1, 2, 3]
    own = report["layers_from"]
    assert own[str(first)]["layer_ids"] == [1, 3] and own[str(second)]["layer_ids"] == [2, 3]
    assert own[str(first)]["bfloat16"] * 3 == pytest.approx(
        report["estimated_compressed_bytes"] * 2, rel=0.01
    )  # + tokens
    assert extract_cli(argv) == 0
    assert f"  alone     {first} [1, 3]:" in capsys.readouterr().out
    assert extract_cli([*argv[:-1], str(tmp_path / "nowhere")]) == 2  # not a drafter directory: usage


def test_two_drafters_train_on_their_own_layers_of_one_store(qwen3_dir, tmp_path):
    store, _ = builders.random_store(
        tmp_path / "store", num_shards=2, samples_per_shard=3, layer_ids=(1, 2, 3), target_dir=qwen3_dir, **SHAPE
    )
    for chosen in ([1, 3], [2, 3]):
        config = load_config(
            None,
            [*RUN, f"model.target_layer_ids=[{chosen[0]},{chosen[1]}]"],
            store=str(store.path),
            target=str(qwen3_dir),
            out=str(tmp_path / f"run{chosen[0]}"),
            **{"train.max_steps": 2},
        )
        trainer = Trainer.from_config(config, log=lambda line: None)
        assert trainer.drafter.config.context_layer_ids == chosen
        trainer.fit()
        sample = next(iter(trainer.loader))
        assert len(sample.features) == 2  # the loader reads only the chosen layers
    refused = load_config(
        None,
        [*RUN, "model.target_layer_ids=[1,4]"],
        store=str(store.path),
        target=str(qwen3_dir),
        out=str(tmp_path / "refused"),
    )
    with pytest.raises(ConfigError, match=r"needs layers \[4\] the store does not hold .* --layers-from"):
        Trainer.from_config(refused)


def test_a_published_dflash2_warm_starts_a_run_on_a_store_with_its_taps(qwen3_dir, tmp_path, capsys):
    published = tmp_path / "published"
    reference = builders.save_reference_dflash2(published, target_layer_ids=(2, 4))
    lacking, _ = builders.random_store(
        tmp_path / "lacking", num_shards=2, samples_per_shard=3, layer_ids=(1, 3), target_dir=qwen3_dir, **SHAPE
    )
    argv = ["fit", "--target", str(qwen3_dir), "--max-steps", "2", "--init-from", str(published), *tiny.cli_sets(RUN)]
    assert train_cli([*argv, "--store", str(lacking.path), "--out", str(tmp_path / "refused")]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "read layers [2, 4] the store does not hold" in error and f"--layers-from {published}" in error, error

    store, _ = builders.random_store(
        tmp_path / "store", num_shards=2, samples_per_shard=3, layer_ids=(1, 2, 3, 4), target_dir=qwen3_dir, **SHAPE
    )
    sets = [s for s in RUN if not s.startswith("model.")]  # the published drafter's shape, not the tiny recipe's
    config = load_config(
        None,
        [*sets, f"model.init_from={published}"],
        store=str(store.path),
        target=str(qwen3_dir),
        out=str(tmp_path / "run"),
        **{"train.max_steps": 2},
    )
    trainer = Trainer.from_config(config, log=lambda line: None)
    theirs = reference.state_dict()
    for name, tensor in trainer.drafter.state_dict().items():  # bit-identical before the first step
        assert torch.equal(tensor, theirs[name if "codebook" not in name else f"{name}.weight"]), name
    assert trainer.drafter.config.is_causal is False and trainer.drafter.config.block_size == 8
    trainer.fit()
    out = export_drafter(trainer.drafter.eval(), tmp_path / "export", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["is_causal"] is False
    reloaded = load_reference(out, DFlash2DraftModel)
    head = load_target_head(qwen3_dir)
    features, input_ids = inputs()  # the drafter's two context layers (2 and 4) of the store's four
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.stack([reference_logits(reloaded, head, features, input_ids, a) for a in ANCHORS])
        ours = head.lm_head(
            trainer.drafter(features, input_ids, torch.tensor(ANCHORS), head.embed_tokens, attention="split")
        )
    assert (ours - expected).abs().max() < 1e-4
    assert list(open_store(store.path).fingerprint.layer_ids) == [1, 2, 3, 4]


@pytest.mark.slow  # a Ray extraction and two trainings
def test_a_store_extracted_for_two_drafters_trains_both_and_each_decodes_losslessly(qwen3_dir, tmp_path, capsys):
    first, second = drafter_dir(qwen3_dir, tmp_path / "a", [1, 3]), drafter_dir(qwen3_dir, tmp_path / "b", [2, 3])
    corpus = builders.write_chat_jsonl(tmp_path / "corpus.jsonl", builders.coding_chats(12))
    store = tmp_path / "store"
    assert (
        extract_cli(
            [
                "run",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--store",
                str(store),
                "--layers-from",
                f"{first},{second}",
                "--workers",
                "1",
                "--device",
                "cpu",
                "--shard-tokens",
                "1024",
                "--max-length",
                "256",
                "--no-progress",
            ]
        )
        == 0
    )
    assert list(open_store(store).fingerprint.layer_ids) == [1, 2, 3]
    for chosen in ([1, 3], [2, 3]):
        run, export = tmp_path / f"run{chosen[0]}", tmp_path / f"export{chosen[0]}"
        assert (
            train_cli(
                [
                    "fit",
                    "--store",
                    str(store),
                    "--target",
                    str(qwen3_dir),
                    "--out",
                    str(run),
                    "--max-steps",
                    "4",
                    *tiny.cli_sets(
                        (*RUN, f"model.target_layer_ids=[{chosen[0]},{chosen[1]}]", "data.heldout_fraction=0.25")
                    ),
                ]
            )
            == 0
        )
        assert train_cli(["export", str(run), "--out", str(export)]) == 0
        assert json.loads((export / "config.json").read_text())["dflash_config"]["target_layer_ids"] == chosen
        capsys.readouterr()
        assert (
            train_cli(
                [
                    "speculate",
                    "--drafter",
                    str(export),
                    "--target",
                    str(qwen3_dir),
                    "--store",
                    str(store),
                    "--limit",
                    "2",
                    "--max-new-tokens",
                    "16",
                    "--json",
                ]
            )
            == 0
        )
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["lossless"] is True
