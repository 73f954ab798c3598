"""A target directory without readable weights is refused before anything runs
(`store_schema.runtime.target_weights`, issue 35 item 5): missing, listed but absent,
truncated, or not safetensors at all, each one line naming the directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

from store_schema.runtime.target_weights import TargetWeightsError, check_target_weights


@pytest.fixture
def copy_of(qwen3_dir, tmp_path):
    """A copy of the tiny target to damage."""
    target = tmp_path / "target"
    shutil.copytree(qwen3_dir, target)
    return target


def test_a_whole_target_passes(qwen3_dir):
    assert check_target_weights(qwen3_dir) == [Path(qwen3_dir) / "model.safetensors"]


def test_no_weights_at_all(copy_of):
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(TargetWeightsError, match=rf"^--target {copy_of}: no weights \(model.safetensors or "):
        check_target_weights(copy_of, "--target")


def test_a_shard_the_index_lists_is_missing(copy_of):
    (copy_of / "model.safetensors").rename(copy_of / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (copy_of / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(TargetWeightsError, match=r"1 of the 2 weights files .* missing \(model-00002-of-00002"):
        check_target_weights(copy_of)


def test_a_truncated_file(copy_of):
    weights = copy_of / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        TargetWeightsError,
        match=rf"model.safetensors is truncated \({len(data) - 100} of "
        rf"{len(data)} bytes\)",
    ):
        check_target_weights(copy_of)


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", b"<html>404</html>"])
def test_a_file_that_is_not_safetensors(copy_of, content):
    (copy_of / "model.safetensors").write_bytes(content)
    with pytest.raises(TargetWeightsError, match=r"model.safetensors is not a safetensors file"):
        check_target_weights(copy_of)


def test_not_a_model_directory_is_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        check_target_weights(tmp_path)


@pytest.mark.slow  # a child process
def test_extract_run_refuses_before_ray_or_a_model_is_imported(copy_of, tmp_path):
    (copy_of / "model.safetensors").unlink()
    (tmp_path / "c.jsonl").write_text("{}\n")
    script = (
        "import sys\nfrom extract.__main__ import main\n"
        f"code = main(['run', '--model', {str(copy_of)!r}, '--corpus', {str(tmp_path / 'c.jsonl')!r}, "
        f"'--store', {str(tmp_path / 'store')!r}, '--layers', '1'])\n"
        "print(code, sorted(m for m in ('ray', 'transformers', 'safetensors') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.strip().splitlines()[-1] == "1 []", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "no weights" in result.stderr
    assert not (tmp_path / "store").exists()
