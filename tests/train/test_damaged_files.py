"""A damaged weights file is one line, never a traceback (issue 62.2): a drafter export
cut short (a partial download), its header unreadable, or a checkpoint cut short, named
with what is wrong and the fix, in `speculate`, `eval`, `fit --init-from` and `--resume`."""

from __future__ import annotations

import builders
import pytest
import tiny
import torch
from random_drafters import dflash_drafter

from train.cli import main
from train.export.drafter_dir import export_drafter
from train.fitting.checkpoint import latest_checkpoint
from train.tensor_files import DamagedTensorFile, read_tensors


@pytest.fixture(scope="module")
def store(tmp_path_factory, qwen3_dir):
    path = tmp_path_factory.mktemp("damaged") / "store"
    builders.random_store(
        path,
        num_shards=2,
        samples_per_shard=3,
        target_dir=qwen3_dir,
        num_target_layers=6,
        hidden_size=64,
        vocab_size=512,
    )
    return path


def cut(file, keep: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:keep])


def damaged_export(qwen3_dir, tmp_path, keep: int):
    export = export_drafter(dflash_drafter(qwen3_dir), tmp_path / "drafter", dtype=torch.float32)
    cut(export / "model.safetensors", keep)
    return export


@pytest.mark.parametrize("keep, problem", [(20_000, "is truncated"), (4, "is not a safetensors file")])
def test_a_damaged_export_is_one_line_in_speculate_and_eval(keep, problem, qwen3_dir, store, tmp_path, capsys):
    export = damaged_export(qwen3_dir, tmp_path, keep)
    weights = export / "model.safetensors"
    with pytest.raises(DamagedTensorFile, match=problem):
        read_tensors(weights)
    for argv in (
        ["speculate", "--drafter", str(export), "--target", str(qwen3_dir), "--store", str(store), "--limit", "1"],
        ["eval", "--drafter", str(export), "--target", str(qwen3_dir), "--store", str(store), "--split", "all"],
    ):
        capsys.readouterr()
        assert main(argv) == 1, argv[0]
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{weights} {problem}" in err and "download the drafter again" in err


def test_a_damaged_init_from_and_checkpoint_are_one_line_in_fit(qwen3_dir, store, tmp_path, capsys):
    sets = tiny.drafter_sets("eval.every=0", "data.heldout_fraction=0.0", "train.checkpoint_every=1", heads=True)
    flags = [x for s in sets for x in ("--set", s)]
    base = ["fit", "--store", str(store), "--target", str(qwen3_dir), *flags]
    export = damaged_export(qwen3_dir, tmp_path, 20_000)
    plain = [x for s in ("eval.every=0", "data.heldout_fraction=0.0") for x in ("--set", s)]  # its shape: the export's
    warm = ["fit", "--store", str(store), "--target", str(qwen3_dir), *plain, "--out", str(tmp_path / "warm")]
    assert main([*warm, "--init-from", str(export), "--max-steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{export / 'model.safetensors'} is truncated" in err

    run = tmp_path / "run"
    assert main([*base, "--out", str(run), "--max-steps", "2"]) == 0
    checkpoint = latest_checkpoint(run)
    weights = sorted(checkpoint.glob("*.safetensors"))[0]
    cut(weights, weights.stat().st_size // 2)
    capsys.readouterr()
    assert main(["fit", "--out", str(run), "--resume", "--max-steps", "3"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{weights} is truncated" in err and "this checkpoint is damaged" in err
