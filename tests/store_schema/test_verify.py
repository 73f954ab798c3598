"""verify at full-scale speed: parallel across shards, each file read once,
`--checksums-only`, progress with an ETA as lines when not on a terminal; an intact
but unfinished store told from a damaged one."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import builders
import numpy as np
import pytest

from store_schema import layout
from store_schema.__main__ import main as cli
from store_schema.commands.verify import ProgressLines
from store_schema.commit.records import on_disk_bytes
from store_schema.tools.verify import verify_store


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

    fingerprint = Fingerprint(
        target_model="t", num_target_layers=4, hidden_size=64, vocab_size=512, layer_ids=[1], max_length=512
    )
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


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_sizes_only_reads_no_shard_file_and_finds_what_sizes_show(big_store, tmp_path, capsys):
    """`--sizes-only` (what `fit` checks of every shard before step 1): commit records
    and the listing only; a truncated file, a missing one and a file no record lists
    are damage, a flipped byte is not seen (the loader's crc32c finds it)."""
    verify_store(big_store, sizes_only=True)
    before = _bytes_read()
    report = verify_store(big_store, sizes_only=True)
    assert report.ok and report.bytes_read == 0 and report.samples == 24
    assert _bytes_read() - before < 0.05 * on_disk_bytes(big_store / layout.SHARDS_DIR)
    copy = tmp_path / "s"
    shutil.copytree(big_store, copy)
    shard = copy / layout.SHARDS_DIR
    flipped = shard / "shard-000000" / "layer_3" / "c" / "0" / "0"
    data = bytearray(flipped.read_bytes())
    data[100] ^= 1
    flipped.write_bytes(bytes(data))
    assert cli(["verify", str(copy), "--sizes-only"]) == 0
    assert "(--sizes-only: commit records and file sizes, nothing read)" in capsys.readouterr().out
    truncated = shard / "shard-000001" / "layer_3" / "c" / "0" / "0"
    truncated.write_bytes(truncated.read_bytes()[:-3])
    (shard / "shard-000002" / "layer_3" / "c" / "0" / "0").unlink()
    (shard / "shard-000003" / "stray").write_bytes(b"x")
    assert cli(["verify", str(copy), "--sizes-only", "--json"]) == 1
    found = {(p["shard"], p["what"].split(" (")[0]) for p in json.loads(capsys.readouterr().out)["problems"]}
    size = truncated.stat().st_size
    assert found == {
        ("shard-000001", f"size {size} != committed {size + 3}"),
        ("shard-000002", "file missing"),
        ("shard-000003", "file not in the commit record"),
    }, found
    assert cli(["verify", str(copy), "--sizes-only", "--checksums-only"]) == 2
    assert "--checksums-only and --sizes-only exclude each other" in capsys.readouterr().err


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


def _flip_a_byte(store: Path, shard: str) -> None:
    chunk = next(p for p in (store / layout.SHARDS_DIR / shard / "layer_1" / "c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


def test_an_intact_store_with_missing_planned_shards_is_incomplete_not_damaged(tmp_path, capsys):
    """Issue 35.7: after a disk-full stop or Ctrl-C, verify printed a PROBLEM per missing
    shard, FAILED and --repair advice; the store is intact and `extract run` finishes it."""
    store = tmp_path / "s"
    builders.random_store(store, num_shards=4, samples_per_shard=2)
    for name in ("shard-000002", "shard-000003"):  # never extracted: a planned shard without a directory
        builders.never_committed(store, name)
    assert cli(["verify", str(store)]) == 3
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "incomplete: 2 of 4 shards committed; rerun `python -m extract run ...` to finish"
    assert "PROBLEM" not in out and "--repair" not in out and "FAILED" not in out, out
    assert cli(["verify", str(store), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert (report["status"], report["planned_shards"], report["missing_shards"]) == ("incomplete", 4, 2)
    assert verify_store(store).status == "incomplete"
    # Damage as well: damaged wins (exit 1), and the missing shards are one count, not a line each.
    _flip_a_byte(store, "shard-000001")
    assert cli(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert out.count("PROBLEM") == 1 and "PROBLEM shard-000001/" in out, out
    assert "--repair moves the damaged shards aside" in out
    assert out.splitlines()[-1] == "FAILED: 1 problem(s), and 2 planned shard(s) missing"


def test_after_repair_the_advice_is_the_rerun(tmp_path, capsys):
    store = tmp_path / "s"
    builders.random_store(store, num_shards=3, samples_per_shard=2)
    _flip_a_byte(store, "shard-000001")
    assert cli(["verify", str(store), "--repair"]) == 3  # every damaged shard moved aside: intact, unfinished
    out = capsys.readouterr().out
    assert "moved 1 damaged shard(s)" in out and "--repair moves" not in out, out
    assert (
        out.splitlines()[-1] == "now incomplete: 2 of 3 shards committed; rerun `python -m extract run ...` to finish"
    )
    assert cli(["verify", str(store)]) == 3
    assert capsys.readouterr().out.splitlines()[-1].startswith("incomplete: 2 of 3 shards committed; rerun")
