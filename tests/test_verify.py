"""verify at full-scale speed: parallel across shards, each file read once,
`--checksums-only`, progress with an ETA as lines when not on a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import builders
from store_schema import layout
from store_schema.__main__ import ProgressLines
from store_schema.__main__ import main as cli
from store_schema.records import on_disk_bytes
from store_schema.verify import verify_store


def _bytes_read() -> int:
    """Bytes this process has read through read(2) so far (page cache hits included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "store"
    builders.random_store(path, num_shards=6, samples_per_shard=4, hidden_size=512)
    return path


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_each_committed_file_is_read_once(big_store):
    verify_store(big_store, workers=1)  # imports and first-use costs out of the way
    before = _bytes_read()
    report = verify_store(big_store, workers=3)
    read = _bytes_read() - before
    assert report.ok and report.bytes_read > 0.9 * on_disk_bytes(big_store / layout.SHARDS_DIR)
    # checksummed and decoded from one read: ~1x the store, where reading twice is 2x
    assert read < 1.3 * on_disk_bytes(big_store), (read, on_disk_bytes(big_store))


def test_workers_give_the_same_report_in_shard_order(big_store, tmp_path):
    import shutil

    copy = tmp_path / "s"
    shutil.copytree(big_store, copy)
    for shard in ("shard-000001", "shard-000004"):
        chunk = copy / layout.SHARDS_DIR / shard / "layer_3" / "c" / "0" / "0"
        data = bytearray(chunk.read_bytes())
        data[100] ^= 1
        chunk.write_bytes(bytes(data))
    reports = [verify_store(copy, workers=n).to_json() for n in (1, 2, 5)]
    assert reports[0] == reports[1] == reports[2]
    assert [p["shard"] for p in reports[0]["problems"]] == ["shard-000001", "shard-000004"]


def test_checksums_only_checks_every_file_but_decodes_nothing(tmp_path, capsys):
    """A NaN written into the states has correct checksums: the quick pass says the
    bytes are intact, the full pass finds the NaN; a flipped byte fails both."""
    import torch

    from store_schema import Fingerprint, SampleArrays, create_store

    fingerprint = Fingerprint(target_model="t", num_target_layers=4, hidden_size=64, vocab_size=512, layer_ids=[1],
                              max_length=512)
    writer = create_store(tmp_path / "s", fingerprint)
    states = torch.randn(30, 64).to(torch.bfloat16)
    states[7, 3] = float("nan")
    writer.write_shard("shard-000000", [SampleArrays("a", np.zeros(30, np.int32), np.ones(30, np.uint8), {1: states})])
    assert cli(["verify", str(tmp_path / "s"), "--checksums-only", "--json"]) == 0
    quick = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert quick["ok"] and quick["checksums_only"] and quick["samples"] == 1 and quick["tokens"] == 30
    assert cli(["verify", str(tmp_path / "s"), "--json"]) == 1
    assert "NaN/Inf, first at token 7" in capsys.readouterr().out
    chunk = tmp_path / "s" / layout.SHARDS_DIR / "shard-000000" / "layer_1" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[50] ^= 4
    chunk.write_bytes(bytes(data))
    assert cli(["verify", str(tmp_path / "s"), "--checksums-only"]) == 1
    assert "PROBLEM shard-000000/layer_1/c/0/0: crc32c" in capsys.readouterr().out
    assert cli(["verify", str(tmp_path / "s"), "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err


def test_progress_prints_lines_with_an_eta_when_not_a_terminal():
    stream = io.StringIO()  # not a TTY
    every_call = ProgressLines(stream, every=0.0)
    for done in range(1, 4):
        every_call(done, 3, done * 1_000_000, 3_000_000)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert lines[0].startswith("verified 1/3 shards, 1.00 MB of 3.00 MB,") and "ETA " in lines[0]
    assert lines[-1].endswith("ETA 0s")
    stream = io.StringIO()
    sparse = ProgressLines(stream, every=3600.0)
    for done in range(1, 4):
        sparse(done, 3, done, 3)
    assert len(stream.getvalue().splitlines()) == 1  # only the last within the interval
