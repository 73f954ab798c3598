"""The full weights check (issue 48.5): the sampled check reads 16 windows of 64 KiB per
weight file, so one tensor scaled by 1.01 between the windows passes it; the digest of
every byte (recorded at extraction, compared with --full-weights-check) does not, and
it is cached by file size and mtime so a host reads a checkpoint once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from store_schema.fingerprint import SAMPLE_BYTES, SAMPLE_WINDOWS, target_identity
from store_schema.runtime import weights_digest


def write_target(path: Path) -> Path:
    """A target directory whose weights file is large enough that the sample misses bytes."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{i}.weight": torch.randn(256, 1024, generator=generator, dtype=torch.float32) for i in range(8)
    }  # 8 MiB
    save_file(tensors, str(path / "model.safetensors"))
    return path


def scale_one_tensor_between_windows(path: Path) -> str:
    """Scale one tensor's middle rows by 1.01 in place, away from every sampled window;
    headers and file size unchanged."""
    file = path / "model.safetensors"
    size = file.stat().st_size
    with open(file, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
    span = size - start - SAMPLE_BYTES
    windows = [(start + span * k // (SAMPLE_WINDOWS - 1), SAMPLE_BYTES) for k in range(SAMPLE_WINDOWS)]
    name = "layers.3.weight"
    header = json.loads(file.read_bytes()[8:start])
    begin, _ = header[name]["data_offsets"]
    row = 1024 * 4
    first = start + begin + 100 * row  # rows 100..110 of the tensor
    assert not any(first < w + n and w < first + 10 * row for w, n in windows), "pick rows between the windows"
    data = bytearray(file.read_bytes())
    values = torch.frombuffer(data[first : first + 10 * row], dtype=torch.float32).clone() * 1.01
    data[first : first + 10 * row] = values.numpy().tobytes()
    stat = file.stat()
    file.write_bytes(bytes(data))
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    return name


def test_a_tensor_scaled_between_the_sampled_windows_is_caught_only_by_the_full_check(tmp_path, monkeypatch):
    monkeypatch.setenv(weights_digest.CACHE_ENV, str(tmp_path / "cache"))
    target = write_target(tmp_path / "target")
    before = target_identity(target)
    scale_one_tensor_between_windows(target)
    after = target_identity(target)
    assert after["target_weights_sample_sha256"] == before["target_weights_sample_sha256"]  # the sample misses it
    assert after["target_weights_index_sha256"] == before["target_weights_index_sha256"]
    assert after["target_weights_sha256"] != before["target_weights_sha256"]


def test_the_digest_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv(weights_digest.CACHE_ENV, str(tmp_path / "cache"))
    target = write_target(tmp_path / "target")
    first = weights_digest.weights_sha256(target)
    entries = list((tmp_path / "cache" / "weights").glob("*.json"))
    assert len(entries) == 1
    cached = json.loads(entries[0].read_text())
    entries[0].write_text(json.dumps({**cached, "crc32c": "00000000"}))  # the cache is what is read
    assert weights_digest.weights_sha256(target) != first
    file = target / "model.safetensors"
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 1))  # touched: read again
    assert weights_digest.weights_sha256(target) == first


@pytest.mark.slow
def test_full_weights_check_refuses_a_changed_tensor_in_eval(tmp_path, qwen3_dir, monkeypatch, capsys):
    """End to end: a store records the digest; `eval --full-weights-check` with a target
    one tensor of which changed is refused naming the field, and a store without the
    digest says the full check cannot be made."""
    import shutil

    import builders

    from train.cli import main

    monkeypatch.setenv(weights_digest.CACHE_ENV, str(tmp_path / "cache"))
    store = tmp_path / "store"
    builders.random_store(store, num_shards=1, num_target_layers=6, target_dir=qwen3_dir)
    changed = tmp_path / "changed"
    shutil.copytree(qwen3_dir, changed)
    tensors = {}
    with safe_open(str(changed / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, str(changed / "model.safetensors"), metadata=metadata)
    argv = [
        "eval",
        "--store",
        str(store),
        "--drafter",
        str(tmp_path / "no-drafter"),
        "--target",
        str(changed),
        "--full-weights-check",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "target_weights_sha256" in err and "is not the checkpoint" in err, err

    older = tmp_path / "older"
    builders.random_store(older, num_shards=1, num_target_layers=6)  # no digest recorded
    assert (
        main(
            [
                "eval",
                "--store",
                str(older),
                "--drafter",
                str(tmp_path / "no-drafter"),
                "--target",
                str(qwen3_dir),
                "--full-weights-check",
            ]
        )
        == 1
    )
    assert "recorded no digest of every weight byte" in capsys.readouterr().err
