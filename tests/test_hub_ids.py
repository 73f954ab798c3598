"""Issue 62.6: hub ids as the ecosystem types them, resolved from the local Hugging Face
cache only (a cache laid out as huggingface_hub lays it out, on loopback disk: nothing
is downloaded)."""

from __future__ import annotations

import argparse
import shutil

import pytest
from builders import coding_chats, write_chat_jsonl
from huggingface_hub import constants

from store_schema.runtime.hub import model_dir_arg


def cache_holding(cache, repo_id: str, source) -> str:
    """`source`'s files as the cached snapshot of `repo_id` (refs/main -> snapshots/<commit>)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo / "snapshots" / commit)
    return str(repo / "snapshots" / commit)


def test_a_cached_hub_id_is_its_snapshot_and_an_uncached_one_says_how_to_fetch_it(qwen3_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = cache_holding(tmp_path / "hub", "tiny/qwen3", qwen3_dir)
    assert model_dir_arg("tiny/qwen3") == snapshot
    assert model_dir_arg(str(qwen3_dir)) == str(qwen3_dir)  # a path stays as given
    assert model_dir_arg("no/such/dir") == "no/such/dir"  # not an id: the command says what is wrong
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        model_dir_arg("Qwen/Qwen3-0.6B")
    message = str(refused.value)
    assert "not in the local Hugging Face cache" in message and str(tmp_path / "hub") in message
    assert "hf download Qwen/Qwen3-0.6B --local-dir DIR" in message


def test_extract_plans_from_a_cached_hub_id_and_refuses_an_uncached_one(qwen3_dir, tmp_path, monkeypatch, capsys):
    from extract.__main__ import main

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cache_holding(tmp_path / "hub", "tiny/qwen3", qwen3_dir)
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(2))
    argv = ["plan", "--corpus", str(corpus), "--store", str(tmp_path / "s"), "--dry-run", "--layers", "1,3"]
    assert main([*argv, "--model", "tiny/qwen3"]) == 0
    with pytest.raises(SystemExit) as usage:
        main([*argv, "--model", "tiny/absent"])
    assert usage.value.code == 2
    assert "argument --model: tiny/absent is not a directory here" in capsys.readouterr().err


def test_a_published_drafter_is_never_told_to_export_a_checkpoint(tmp_path):
    """A partial download (config.json, no weights) is named as one; only a run with
    checkpoints is told to export."""
    import json

    from train.export.drafter_dir import resolve_drafter_dir

    download = tmp_path / "Qwen3-8B-DFlash-b16"
    download.mkdir()
    (download / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": {}}))
    with pytest.raises(FileNotFoundError, match="without model.safetensors beside it") as partial:
        resolve_drafter_dir(download)
    assert "export" not in str(partial.value)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "state.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="export a checkpoint first"):
        resolve_drafter_dir(run)
