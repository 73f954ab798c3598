"""The main job end to end, through the command lines a user runs: extract with
2 Ray workers -> verify -> fit a few steps -> eval -> speculate -> export -> reload,
no third-party progress bar on any command's stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from builders import coding_chats, write_chat_jsonl
from paths import REPO

pytestmark = pytest.mark.slow  # child processes


def _cli(*args, expect: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == expect, (
        f"{args[:3]}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    for bar in ("it/s]", "s/it]", "Loading weights"):  # a third-party progress bar (tqdm), never the project's lines
        assert bar not in result.stderr, f"{args[:3]} printed a progress bar: {result.stderr[-2000:]}"
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {"text": result.stdout}


def test_extract_verify_fit_eval_export_reload(qwen3_5_dir, tmp_path):
    corpus = write_chat_jsonl(tmp_path / "corpus.jsonl", coding_chats(24))
    store, run, export = tmp_path / "store", tmp_path / "run", tmp_path / "drafter"

    report = _cli(
        "-m",
        "extract",
        "run",
        "--model",
        qwen3_5_dir,
        "--corpus",
        corpus,
        "--store",
        store,
        "--workers",
        2,
        "--device",
        "cpu",
        "--layers",
        "1,3,5",
        "--max-length",
        256,
        "--shard-tokens",
        1024,
        "--no-progress",
    )
    assert report["samples"] == 24 and report["shards_written"] >= 2

    assert _cli("-m", "store_schema", "verify", store, "--json")["ok"] is True

    _cli(
        "-m",
        "train",
        "fit",
        "--store",
        store,
        "--target",
        qwen3_5_dir,
        "--out",
        run,
        "--max-steps",
        6,
        "--set",
        "model.num_hidden_layers=1",
        "--set",
        "model.num_anchors=16",
        "--set",
        "data.heldout_fraction=0.2",
        "--set",
        "train.log_every=2",
        "--set",
        "eval.every=3",
        "--set",
        "eval.samples=2",
    )
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log if "loss" in r)
    assert any("eval_tau" in r for r in log), "acceptance is evaluated during training"

    _cli("-m", "train", "export", run, "--out", export, "--dtype", "float32")
    config = json.loads((export / "config.json").read_text())
    # The defaults train DFlash 2 (drafter_bench's measurement).
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["target_layer_ids"] == [1, 3, 5]

    evaluation = _cli(
        "-m",
        "train",
        "eval",
        "--store",
        store,
        "--drafter",
        export,
        "--target",
        qwen3_5_dir,
        "--ddtree-budgets",
        "4,16",
        "--json",
    )
    assert evaluation["heldout_fraction"] == 0.2  # the run's split, as the export records it
    assert evaluation["samples"] > 0 and 1.0 <= evaluation["tau"] <= 16.0
    assert set(evaluation["ddtree"]) == {"4", "16"}
    decoded = _cli(
        "-m",
        "train",
        "speculate",
        "--drafter",
        export,
        "--target",
        qwen3_5_dir,
        "--store",
        store,
        "--limit",
        1,
        "--max-new-tokens",
        8,
        "--json",
    )
    assert decoded["lossless"] is True

    from train.export.drafter_dir import load_drafter
    from train.families.dflash.build import build_drafter
    from train.families.dflash.model import DrafterConfig
    from train.fitting import checkpoint

    state_dir = checkpoint.latest_checkpoint(run)
    trained = build_drafter(DrafterConfig.from_state(checkpoint.read_state(state_dir)))
    trained.load_state_dict(checkpoint.load_model_weights(state_dir))
    reloaded = load_drafter(export)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
