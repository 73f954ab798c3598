"""Fault suite, corruption: 50 seeded injections over a finished store, one written
with the default codec and one fp8 store (per-token scale arrays beside the layers).
`verify` must detect every one, name the shard and file, and exit 1."""

from __future__ import annotations

import json
import random
import shutil
from functools import partial
from pathlib import Path

import builders
import pytest
import tiny
from paths import REPO

from store_schema import CorruptShardError, Store
from store_schema.__main__ import main as cli
from train.families.dflash.anchors import has_anchor

pytestmark = pytest.mark.slow  # fault injection

INJECTIONS = 50
KINDS = ("flip_data", "flip_index", "flip_metadata", "truncate", "delete_shard", "delete_commit_record")


@pytest.fixture(scope="module", params=["bfloat16", "fp8_e4m3"])
def finished_store(tmp_path_factory, request) -> Path:
    path = tmp_path_factory.mktemp("finished") / "store"
    builders.random_store(path, num_shards=4, samples_per_shard=3, topk=2, dtype=request.param)
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
        # A deleted committed shard is damage too: the store's journal remembers its commit (issue 47.4).
        expected = (1, "damaged")
        assert (code, report["status"]) == expected and not report["ok"], f"injection {i} ({kind} {shard}/{file})"
        problems = report["problems"]
        if shard:
            assert any(p["shard"] == shard for p in problems), (kind, shard, problems)
        if file and kind != "delete_shard":
            assert any(file in (p["file"], p["array"]) or p["file"].endswith(file) for p in problems), (
                kind,
                file,
                problems,
            )
        detected += 1
        shutil.rmtree(copy)
    assert detected == INJECTIONS


@pytest.mark.faults
def test_reader_and_verify_refuse_every_corrupted_shard_file(finished_store, tmp_path):
    """What the trainer relies on: a whole-shard read of a damaged shard raises,
    naming the shard and file, for a flipped byte in any of its files (an fp8
    store's scale arrays included); verify names the same file."""
    from store_schema.tools.verify import verify_store

    copy = tmp_path / "s"
    shutil.copytree(finished_store, copy)
    shard_dir = copy / "shards" / "shard-000001"
    hit = []
    for path in sorted(p for p in shard_dir.rglob("*") if p.is_file() and p.name != "commit.json"):
        original = path.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        rel = path.relative_to(shard_dir).as_posix()
        with pytest.raises(CorruptShardError, match=f"shard-000001: {rel}"):
            Store(copy).read_shard("shard-000001")
        problems = verify_store(copy, workers=2).problems
        assert [(p["shard"], p["file"]) for p in problems] == [("shard-000001", rel)], problems
        hit.append(rel)
        path.write_bytes(original)
    Store(copy).read_shard("shard-000001")
    if Store(copy).dtype.scaled:
        assert {"layer_1_scale/c/0", "layer_3_scale/zarr.json"} <= set(hit)


# --------------------------------------------------------------------------- the trainer's side


def _loader(store, log=print, **kwargs):
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader

    return ShardLoader(
        store,
        DataConfig(heldout_fraction=0.0, **kwargs),
        LoaderSpec([1, 3], partial(has_anchor, 8), seed=0, epochs=1),
        log=log,
    )


@pytest.mark.faults
def test_training_never_reads_a_corrupted_shard(tmp_path):
    """The same 50 seeded injections, seen by the trainer's loader: a damaged shard is
    refused naming the shard and file, or (skip_corrupt_shards) left out and logged;
    a shard whose directory or commit record is gone is not committed, so never read;
    every sample that is delivered is bit-identical to what was written."""
    import numpy as np
    import torch

    path = tmp_path / "store"
    _, written = builders.random_store(path, num_shards=4, samples_per_shard=3, topk=2)
    original = {s.sample_id: (shard, s) for shard, samples in written.items() for s in samples}
    rng = random.Random(1234)  # the seed of the verify test: the same 50 faults
    survived = 0
    for i in range(INJECTIONS):
        kind = KINDS[i % len(KINDS)]
        copy = tmp_path / f"c{i}"
        shutil.copytree(path, copy)
        shard, file = _inject(copy, kind, rng)
        store = Store(copy)
        damaged_file = bool(shard) and kind not in ("delete_shard", "delete_commit_record")
        if damaged_file:
            with pytest.raises(CorruptShardError, match=f"shard {shard}: {file}: .*skip_corrupt_shards"):
                list(_loader(store))
        messages = []
        loader = _loader(store, skip_corrupt_shards=True, log=messages.append)
        delivered = list(loader)
        ids = [s.sample_id for s in delivered]
        if shard:
            assert not any(original[sid][0] == shard for sid in ids), (i, kind, shard)
            assert sorted(ids) == sorted(sid for sid, (name, _) in original.items() if name != shard), (i, kind)
        else:  # store-level metadata (plan, root records): verify's business, the data is intact
            assert sorted(ids) == sorted(original), (i, kind, file)
        if damaged_file:
            assert loader.skipped_shards == [shard] and any(shard in m and file in m for m in messages), messages
        else:
            assert loader.skipped_shards == []
        for sample in delivered:
            want = original[sample.sample_id][1]
            assert np.array_equal(sample.input_ids.numpy(), want.input_ids)
            assert all(torch.equal(f, want.hidden[layer]) for f, layer in zip(sample.features, (1, 3)))
        survived += 1
        shutil.rmtree(copy)
    assert survived == INJECTIONS


@pytest.mark.faults
def test_fit_refuses_a_corrupt_shard_or_skips_it_and_never_trains_on_it(qwen3_dir, tmp_path):
    """`python -m train fit` on a store with one flipped byte: exit 1 naming shard and
    file (the integrity pass before step 1). With data.skip_corrupt_shards=true the run
    completes, names the shard once, and no training step ever sees a sample of it."""
    import subprocess
    import sys

    from train.config_loading import load_config
    from train.fitting.trainer import Trainer

    path = tmp_path / "store"
    _, written = builders.random_store(path, num_shards=4, samples_per_shard=3, num_target_layers=6)
    bad = "shard-000002"
    chunk = path / "shards" / bad / "layer_3" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x04
    chunk.write_bytes(bytes(data))
    sets = tiny.drafter_sets("eval.every=0", "data.heldout_fraction=0.0", "train.epochs=2")

    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "fit",
            "--store",
            str(path),
            "--target",
            str(qwen3_dir),
            "--out",
            str(tmp_path / "run"),
            *tiny.cli_sets(sets),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 1, refused.stderr[-2000:]
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: shard {bad}: layer_3/c/0/0: crc32c") and "skip_corrupt_shards" in error, error

    messages = []
    config = load_config(
        None,
        sets + ["data.skip_corrupt_shards=true"],
        store=str(path),
        target=str(qwen3_dir),
        out=str(tmp_path / "skip"),
    )
    trainer = Trainer.from_config(config, log=messages.append)
    seen = []
    run_sequence = trainer.run_sequence

    def recording(sample, *args, **kwargs):  # what every training step is computed on
        seen.append((sample.shard, sample.sample_id))
        return run_sequence(sample, *args, **kwargs)

    trainer.run_sequence = recording
    trainer.fit()
    assert seen and not any(shard == bad for shard, _ in seen)
    assert {sid for _, sid in seen} == {
        s.sample_id for name, samples in written.items() if name != bad for s in samples
    }
    # The integrity pass before step 1 named it (once); the loader never read it.
    assert any(f"damaged shard(s) left out (data.skip_corrupt_shards): {bad}" in m for m in messages), messages
    assert not any("skipping corrupt shard" in m for m in messages), messages


# --------------------------------------------------------------------------- captures without signal (issue 27.3)

DEPTH_RMS = {1: 0.5, 3: 4.0}  # hidden-state RMS grows with depth in real targets


@pytest.fixture(scope="module", params=["bfloat16", "fp8_e4m3"])
def depth_store(tmp_path_factory, request) -> Path:
    path = tmp_path_factory.mktemp("depth") / "store"
    builders.random_store(path, num_shards=4, samples_per_shard=3, dtype=request.param, layer_rms=DEPTH_RMS)
    assert cli(["verify", str(path)]) == 0
    return path


def _empty_states(kind: str, like):
    import torch

    if kind == "zeroed":
        return torch.zeros_like(like)
    return like[:1].expand_as(like).clone()  # every token the first one's states


@pytest.mark.faults
@pytest.mark.parametrize("kind", ["zeroed", "constant"])
def test_the_writer_refuses_a_layer_without_signal_naming_shard_and_layer(kind, tmp_path):
    """Issue 27.3: a capture whose layer is all zeros or the same for every token is
    never committed (bf16 and fp8 stores); the error names shard and layer."""
    import numpy as np

    from store_schema import SampleArrays
    from store_schema.layer_stats import EmptyCaptureError

    for dtype in ("bfloat16", "fp8_e4m3"):
        writer, shards = builders.random_store(tmp_path / dtype, num_shards=1, dtype=dtype, with_plan=False)
        good = shards["shard-000000"][0]
        bad = SampleArrays(
            "bad", good.input_ids, good.loss_mask, {1: good.hidden[1], 3: _empty_states(kind, good.hidden[3])}
        )
        why = "all zeros" if kind == "zeroed" else "constant across tokens"
        with pytest.raises(EmptyCaptureError, match=f"shard shard-000001: captured layer 3 is {why}"):
            writer.write_shard("shard-000001", [bad])
        assert Store(tmp_path / dtype).committed_shards() == ["shard-000000"]
        assert not any((tmp_path / dtype / ".staging").iterdir())
        assert np.isclose(Store(tmp_path / dtype).commit("shard-000000").layer_stats[1].rms, 1.0, rtol=0.1)


def _rewrite_layers(shard_dir: Path, kind: str, keep_stats: bool) -> None:
    """Change a committed shard's states and re-sign its commit record, as a buggy
    capture (or another tool) would leave it: checksums right, states wrong. With
    `keep_stats` False the record has no statistics (a store written before them).
    States are re-encoded by the store's own encoder (zarr would drop an all-zero shard file)."""
    import numpy as np
    import zarr

    from store_schema.codecs.encoding import write_bytesplit_shard
    from store_schema.commit.records import describe_files, read_record, write_record
    from store_schema.layout import WRITE_ALL_CHUNKS

    if kind == "swapped":
        for suffix in ("", "_scale"):
            first, second = shard_dir / f"layer_1{suffix}", shard_dir / f"layer_3{suffix}"
            if first.exists():
                first.rename(shard_dir / "swap")
                second.rename(first)
                (shard_dir / "swap").rename(second)
    else:
        store = Store(shard_dir.parents[1])
        bits = np.array(zarr.open_array(str(shard_dir / "layer_3"), mode="r")[...]).view(store.dtype.bits)
        bits = np.zeros_like(bits) if kind == "zeroed" else np.repeat(bits[:1], len(bits), axis=0)
        write_bytesplit_shard(shard_dir / "layer_3" / "c" / "0" / "0", bits, store.codec)
        if kind == "constant" and (shard_dir / "layer_3_scale").exists():
            scales = zarr.open_array(str(shard_dir / "layer_3_scale"), mode="r+", config=WRITE_ALL_CHUNKS)
            scales[...] = np.repeat(scales[:1], scales.shape[0])
    body = read_record(shard_dir / "commit.json")
    body["files"] = describe_files(shard_dir, exclude=("commit.json",))
    if not keep_stats:
        body.pop("layer_stats")
    write_record(shard_dir / "commit.json", body)


@pytest.mark.faults
@pytest.mark.parametrize("kind", ["zeroed", "constant", "swapped"])
@pytest.mark.parametrize("keep_stats", [True, False], ids=["recorded-stats", "older-store"])
def test_verify_catches_a_layer_zeroed_constant_or_swapped(depth_store, kind, keep_stats, tmp_path, capsys):
    """Issue 27.3: states rewritten with valid checksums, in a store that recorded
    statistics (they no longer match) and in an older one that did not (the data alone
    tells): verify exits 1 naming the shard and the layer array."""
    copy = tmp_path / "store"
    shutil.copytree(depth_store, copy)
    _rewrite_layers(copy / "shards" / "shard-000002", kind, keep_stats)
    assert cli(["verify", str(copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    flagged = {(p["shard"], p["array"]) for p in report["problems"]}
    layers = {"layer_3"} if kind != "swapped" else {"layer_1", "layer_3"}
    assert flagged == {("shard-000002", layer) for layer in layers}, report["problems"]
    whats = " ".join(p["what"] for p in report["problems"])
    expected = {"zeroed": "all zeros", "constant": "constant across tokens", "swapped": "store's median"}[kind]
    assert expected in whats and (not keep_stats or "differ from the statistics recorded at commit" in whats), whats


@pytest.mark.faults
def test_verify_catches_layers_swapped_by_the_capture_itself(tmp_path, capsys):
    """Two layers swapped before the writer saw them: the shard's statistics agree with
    its data, but not with the other shards' for those layer ids (median token RMS
    off by more than MEDIAN_FACTOR), in a full verify and in --checksums-only (from
    the recorded statistics)."""
    from store_schema import SampleArrays

    path = tmp_path / "store"
    writer, shards = builders.random_store(
        path, num_shards=4, samples_per_shard=3, layer_rms=DEPTH_RMS, with_plan=False
    )
    writer.write_shard(
        "shard-000004",
        [
            SampleArrays(s.sample_id + "-x", s.input_ids, s.loss_mask, {1: s.hidden[3], 3: s.hidden[1]})
            for s in shards["shard-000001"]
        ],
    )
    for flags in ([], ["--checksums-only"]):
        assert cli(["verify", str(path), "--json", *flags]) == 1
        problems = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problems"]
        assert {(p["shard"], p["array"]) for p in problems} == {
            ("shard-000004", "layer_1"),
            ("shard-000004", "layer_3"),
        }
        assert all("median" in p["what"] for p in problems), problems
