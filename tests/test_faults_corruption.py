"""Fault suite, corruption: 50 seeded injections over a finished store. `verify`
must detect every one, name the shard and file, and exit 1."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

import builders
from store_schema import CorruptShardError, Store
from store_schema.__main__ import main as cli

INJECTIONS = 50
KINDS = ("flip_data", "flip_index", "flip_metadata", "truncate", "delete_shard", "delete_commit_record")


@pytest.fixture(scope="module")
def finished_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("finished") / "store"
    builders.random_store(path, num_shards=4, samples_per_shard=3, topk=2)
    assert cli(["verify", str(path)]) == 0
    return path


def _inject(store: Path, kind: str, rng: random.Random) -> tuple[str, str]:
    """Apply one fault; return (shard, file) it hit ('' where not applicable)."""
    shards = sorted(p.name for p in (store / "shards").iterdir() if p.is_dir())
    shard = rng.choice(shards)
    shard_dir = store / "shards" / shard
    if kind in ("delete_shard", "delete_commit_record"):
        if kind == "delete_shard":
            shutil.rmtree(shard_dir)
            return shard, ""
        (shard_dir / "commit.json").unlink()
        return shard, "commit.json"
    if kind == "flip_metadata":
        candidates = [p for p in store.rglob("*") if p.is_file() and p.name.endswith(".json")]
    elif kind == "flip_index":
        candidates = list(shard_dir.glob("layer_*/c/0/0"))
    else:
        candidates = [p for p in shard_dir.rglob("*") if p.is_file() and not p.name.endswith(".json")]
    path = rng.choice(sorted(candidates))
    data = bytearray(path.read_bytes())
    if kind == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(len(data))]))
    else:
        if kind == "flip_index":
            position = len(data) - 1 - rng.randrange(min(len(data), 20))  # the shard index + its crc at the end
        else:
            position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    rel = path.relative_to(store)
    if rel.parts[0] == "shards" and len(rel.parts) > 2:
        return rel.parts[1], "/".join(rel.parts[2:])
    return "", rel.as_posix()


@pytest.mark.faults
def test_verify_detects_every_seeded_corruption(finished_store, tmp_path, capsys):
    rng = random.Random(1234)
    detected = 0
    for i in range(INJECTIONS):
        kind = KINDS[i % len(KINDS)]
        copy = tmp_path / f"c{i}"
        shutil.copytree(finished_store, copy)
        shard, file = _inject(copy, kind, rng)
        code = cli(["verify", str(copy), "--json"])
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert code == 1 and not report["ok"], f"injection {i} ({kind} {shard}/{file}) went unnoticed"
        problems = report["problems"]
        if shard:
            assert any(p["shard"] == shard for p in problems), (kind, shard, problems)
        if file and kind != "delete_shard":
            assert any(file in (p["file"], p["array"]) or p["file"].endswith(file) for p in problems), (kind, file, problems)
        detected += 1
        shutil.rmtree(copy)
    assert detected == INJECTIONS


@pytest.mark.faults
def test_reader_refuses_every_corrupted_shard_file(finished_store, tmp_path):
    """What the trainer relies on: a whole-shard read of a damaged shard raises,
    naming the shard and file, for a flipped byte in any of its files."""
    copy = tmp_path / "s"
    shutil.copytree(finished_store, copy)
    shard_dir = copy / "shards" / "shard-000001"
    for path in sorted(p for p in shard_dir.rglob("*") if p.is_file() and p.name != "commit.json"):
        original = path.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        rel = path.relative_to(shard_dir).as_posix()
        with pytest.raises(CorruptShardError, match=f"shard-000001: {rel}"):
            Store(copy).read_shard("shard-000001")
        path.write_bytes(original)
    Store(copy).read_shard("shard-000001")
