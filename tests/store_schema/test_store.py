"""The store contract on real Zarr stores on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import builders
import numpy as np
import pytest
import torch
import zarr
from paths import REPO

from store_schema import (
    CodecConfig,
    CorruptShardError,
    Fingerprint,
    FingerprintMismatch,
    SampleArrays,
    Store,
    StoreExistsError,
    StoreLock,
    StoreLockedError,
    create_store,
)
from store_schema.__main__ import main as cli
from store_schema.codecs.bf16 import BFLOAT16
from store_schema.stores import backend
from store_schema.tools.verify import verify_store


def _fingerprint(**overrides):
    values = dict(target_model="t", num_target_layers=4, hidden_size=256, vocab_size=512, layer_ids=[1], max_length=512)
    values.update(overrides)
    return Fingerprint(**values)


def test_bf16_round_trip_is_bit_exact_for_every_pattern(tmp_path):
    """All 65,536 bf16 bit patterns (NaN payloads, +-Inf, subnormals, -0) survive
    the writer, the fast shard reader, windowed reads and plain zarr-python."""
    bits = np.arange(2**16, dtype=np.uint16)
    hidden = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).reshape(256, 256)
    writer = create_store(tmp_path / "s", _fingerprint(), CodecConfig(chunk_bytes=8192))
    ids = np.zeros(256, np.int32)
    writer.write_shard("shard-000000", [SampleArrays("a", ids, np.ones(256, np.uint8), {1: hidden})])
    store = Store(tmp_path / "s")

    whole = store.read_shard("shard-000000").sample(0).hidden[1]
    window = store.read_window("shard-000000", 0, 17, 200, [1]).hidden[1]
    plain = zarr.open_array(str(tmp_path / "s/shards/shard-000000/layer_1"), mode="r")[...]

    assert plain.dtype == BFLOAT16
    assert np.array_equal(whole.view(torch.int16).numpy().view(np.uint16).ravel(), bits)
    assert torch.equal(window.view(torch.int16), hidden[17:200].view(torch.int16))
    assert np.array_equal(plain.view(np.uint16).ravel(), bits)
    meta = json.loads((tmp_path / "s/shards/shard-000000/layer_1/zarr.json").read_text())
    assert meta["data_type"] == "bfloat16"


@pytest.mark.parametrize(
    "codec",
    [
        CodecConfig(chunk_bytes=2048),
        CodecConfig(name="blosc", chunk_bytes=2048),
        CodecConfig(name="none", chunk_bytes=2048),
        CodecConfig(name="channels", channel_rows=128),
    ],
    ids=lambda c: c.name,
)
def test_reads_return_what_was_written(tmp_path, codec):
    writer, shards = builders.random_store(tmp_path / "s", codec=codec, topk=4)
    store = Store(tmp_path / "s")
    assert store.committed_shards() == sorted(shards)
    for data in store.iter_shards(store.committed_shards(), prefetch=2):
        for i, expected in enumerate(shards[data.name]):
            got = data.sample(i)
            assert got.sample_id == expected.sample_id
            assert np.array_equal(got.input_ids.numpy(), expected.input_ids)
            assert np.array_equal(got.loss_mask.numpy(), expected.loss_mask)
            assert np.array_equal(got.topk_ids.numpy(), expected.topk_ids)
            for layer in (1, 3):
                assert torch.equal(got.hidden[layer], expected.hidden[layer])
    # Only the asked-for layers are read.
    assert set(store.read_shard("shard-000001", layers=[3]).hidden) == {3}
    # The chunk layout is what the codec config says: a blosc block is a whole chunk,
    # of whole rows, or (`channels`) of 8 channels, a 16-byte blosc element a row.
    meta = json.loads((tmp_path / "s/shards/shard-000000/layer_1/zarr.json").read_text())
    inner = meta["codecs"][0]["configuration"]
    rows, cols = codec.chunk_shape(meta["shape"][0], 64, 2)
    assert inner["chunk_shape"] == [rows, cols]
    assert cols == (8 if codec.name == "channels" else 64)
    if codec.name != "none":
        blosc = inner["codecs"][1]["configuration"]
        assert blosc["blocksize"] == rows * cols * 2
        assert blosc["typesize"] == (16 if codec.name == "channels" else 2)
        assert blosc["shuffle"] == "shuffle"


@pytest.mark.slow  # child processes
def test_crash_before_commit_leaves_nothing_visible(tmp_path):
    builders.random_store(tmp_path / "s", num_shards=1, with_plan=False)
    script = f"""
import os, sys
sys.path.insert(0, {str(REPO / "tests")!r}); sys.path.insert(0, {str(REPO)!r})
import numpy as np, torch
from store_schema import StoreWriter, SampleArrays
writer = StoreWriter({str(tmp_path / "s")!r})
os.rename = lambda *a: os._exit(3)  # the process dies at the moment of commit
writer.write_shard('shard-000009', [SampleArrays('x', np.zeros(50, np.int32), np.ones(50, np.uint8),
                   {{1: torch.randn(50, 64).bfloat16(), 3: torch.randn(50, 64).bfloat16()}})])
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert result.returncode == 3, result.stderr.decode()

    store = Store(tmp_path / "s")
    assert store.committed_shards() == ["shard-000000"]
    report = verify_store(tmp_path / "s")
    assert report.ok, report.problems
    assert len(report.leftovers) == 1 and report.leftovers[0].startswith("shard-000009.")
    assert backend(tmp_path / "s").clean() == (report.leftovers, [])  # `verify --clean`
    assert verify_store(tmp_path / "s").leftovers == []


def test_verify_passes_on_a_clean_store(tmp_path, capsys):
    builders.random_store(tmp_path / "s", topk=2)
    assert cli(["verify", str(tmp_path / "s"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] is True and out["problems"] == [] and out["samples"] == 12


def _all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and ".lock" not in p.name)


def test_verify_detects_a_flipped_byte_in_every_file(tmp_path):
    """One byte flipped in any data or metadata file, root and plan included."""
    builders.random_store(tmp_path / "s", num_shards=1, samples_per_shard=2)
    files = _all_files(tmp_path / "s")
    assert len(files) > 15
    for path in files:
        original = path.read_bytes()
        for position in {0, len(original) // 2, len(original) - 1}:
            corrupted = bytearray(original)
            corrupted[position] ^= 0x01
            path.write_bytes(bytes(corrupted))
            report = verify_store(tmp_path / "s")
            path.write_bytes(original)
            assert not report.ok, f"flipped byte {position} of {path.relative_to(tmp_path)} went unnoticed"
    assert verify_store(tmp_path / "s").ok


def test_verify_detects_truncation_deletion_nan_and_fingerprint_edit(tmp_path, capsys):
    store_path = tmp_path / "s"
    _, shards = builders.random_store(store_path)

    data_file = store_path / "shards/shard-000001/layer_3/c/0/0"
    original = data_file.read_bytes()
    data_file.write_bytes(original[:-10])
    assert cli(["verify", str(store_path), "--json"]) == 1
    problem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problems"][0]
    assert problem["shard"] == "shard-000001" and problem["file"] == "layer_3/c/0/0" and "truncated" in problem["what"]
    data_file.write_bytes(original)

    import shutil

    shutil.move(store_path / "shards/shard-000002", tmp_path / "moved")
    report = verify_store(store_path)
    assert [(p["shard"], "missing" in p["what"]) for p in report.problems] == [("shard-000002", True)]
    shutil.move(tmp_path / "moved", store_path / "shards/shard-000002")

    root_meta = store_path / "zarr.json"
    original_root = root_meta.read_text()
    meta = json.loads(original_root)
    meta["attributes"]["dflash_store"]["fingerprint"]["hidden_size"] = 128
    root_meta.write_text(json.dumps(meta))
    report = verify_store(store_path)
    assert any("fingerprint" in p["what"] for p in report.problems)
    root_meta.write_text(original_root)
    assert verify_store(store_path).ok


def test_write_shard_returns_the_commit_it_wrote_and_none_for_a_committed_shard(tmp_path):
    """What a worker reports (`disk_bytes`) comes from the writer, not from reading the store back."""
    writer = create_store(tmp_path / "s", _fingerprint(hidden_size=64), CodecConfig(chunk_bytes=2048))
    sample = SampleArrays("a", np.zeros(100, np.int32), np.ones(100, np.uint8), {1: torch.randn(100, 64)})
    commit = writer.write_shard("shard-000000", [sample])
    assert commit == Store(tmp_path / "s").commit("shard-000000")
    shard = tmp_path / "s/shards/shard-000000"
    assert commit.disk_bytes == sum((shard / rel).stat().st_size for rel in commit.files) > 0
    assert writer.write_shard("shard-000000", [sample]) is None  # committed already: kept


def test_verify_detects_nan_and_inf_written_into_hidden_states(tmp_path):
    writer = create_store(tmp_path / "s", _fingerprint(hidden_size=64), CodecConfig(chunk_bytes=2048))
    hidden = torch.randn(100, 64).to(torch.bfloat16)
    hidden[37, 5] = float("nan")
    hidden[80, 0] = float("inf")
    writer.write_shard(
        "shard-000000", [SampleArrays("a", np.zeros(100, np.int32), np.ones(100, np.uint8), {1: hidden})]
    )
    report = verify_store(tmp_path / "s")
    assert [p["array"] for p in report.problems] == ["layer_1"]
    assert "2 token(s) with NaN/Inf, first at token 37" in report.problems[0]["what"]


def test_reader_refuses_a_corrupted_shard_naming_the_file(tmp_path):
    builders.random_store(tmp_path / "s", num_shards=1)
    path = tmp_path / "s/shards/shard-000000/layer_1/c/0/0"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="shard-000000: layer_1/c/0/0: crc32c"):
        Store(tmp_path / "s").read_shard("shard-000000")


def test_reader_names_missing_layers_and_mismatched_fields(tmp_path):
    builders.random_store(tmp_path / "s", num_shards=1)
    store = Store(tmp_path / "s")
    with pytest.raises(KeyError, match=r"no layer\(s\) \[2\]; it holds layers \[1, 3\]"):
        store.read_shard("shard-000000", layers=[1, 2])
    with pytest.raises(FingerprintMismatch, match="hidden_size: store has 64, expected 5120"):
        store.fingerprint.check(hidden_size=5120, vocab_size=512)


def test_a_store_made_before_the_target_config_was_recorded_still_resumes():
    """The target's config.json joined the fingerprint later: an older store records
    none, which says nothing differs (a resumed `extract run` was refused on it);
    one recorded and different is named."""
    config = {"hidden_size": 256, "num_attention_heads": 8}
    older, now = _fingerprint(), _fingerprint(target_config=config)
    assert older.diff(now) == {}
    other = _fingerprint(target_config={**config, "num_attention_heads": 4})
    assert list(other.diff(now)) == ["target_config"]


def test_final_layer_is_never_a_context_layer():
    with pytest.raises(ValueError, match="final layer"):
        _fingerprint(num_target_layers=4, layer_ids=[1, 3])


def test_existing_store_is_kept_unless_overwrite(tmp_path):
    builders.random_store(tmp_path / "s", num_shards=1)
    with pytest.raises(StoreExistsError):
        create_store(tmp_path / "s", _fingerprint())
    create_store(tmp_path / "s", _fingerprint(), overwrite=True)
    assert Store(tmp_path / "s").committed_shards() == []


_WRITE_ONE_SHARD = """
import sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {repo!r})
import numpy as np, torch
from store_schema import StoreWriter, SampleArrays
index = int(sys.argv[1])
writer = StoreWriter({store!r})
samples = [SampleArrays(f"p{{index}}-{{i}}", np.full(300, i, np.int32), np.ones(300, np.uint8),
           {{1: (index + torch.arange(300).remainder(2)[:, None].expand(300, 256) - 0.5).bfloat16()}})
           for i in range(20)]  # tokens alternate index -+ 0.5: mean index, and not constant (refused)
assert writer.write_shard(f"shard-{{index:06d}}", samples)
"""


@pytest.mark.slow  # child processes
def test_two_processes_writing_different_shards_leave_a_valid_store(tmp_path):
    create_store(tmp_path / "s", _fingerprint(), CodecConfig(chunk_bytes=4096))
    script = _WRITE_ONE_SHARD.format(tests=str(REPO / "tests"), repo=str(REPO), store=str(tmp_path / "s"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)]) for i in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    store = Store(tmp_path / "s")
    assert store.committed_shards() == ["shard-000000", "shard-000001"]
    report = verify_store(tmp_path / "s")
    assert report.ok and report.samples == 40
    assert float(store.read_shard("shard-000001").hidden[1].float().mean()) == 1.0


@pytest.mark.slow  # child processes
def test_a_live_job_holds_the_store_and_a_dead_one_does_not(tmp_path):
    (tmp_path / "s").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys,time; sys.path.insert(0,{str(REPO)!r});"
            f"from store_schema import StoreLock; l=StoreLock({str(tmp_path / 's')!r}).acquire(); "
            "print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout.readline().strip() == b"held"
    with pytest.raises(StoreLockedError, match="held by another live job"):
        StoreLock(tmp_path / "s").acquire()
    holder.kill()
    holder.wait()
    with StoreLock(tmp_path / "s"):
        pass


@pytest.mark.slow  # child processes
def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert cli(["verify", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nowhere'}: does not exist\n"  # issue 62.8
    (tmp_path / "empty").mkdir()
    assert cli(["info", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'empty'}: not a zarr store (no zarr.json)\n"
    assert cli(["info", str(tmp_path / "nowhere")]) == 2
    assert cli(["verify"]) == 2
    builders.random_store(tmp_path / "s", num_shards=1)
    assert cli(["info", str(tmp_path / "s"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["samples"] == 4 and summary["layers"] == ["layer_1", "layer_3"]
    assert 0 < summary["ratio"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "store_schema", "verify", str(tmp_path / "s")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and "OK: store is intact" in result.stdout


def test_info_counts_quarantined_records_by_reason(tmp_path, capsys):
    """Issue 35.10: `info` never showed the records the plan left out."""
    from store_schema import QuarantinedRecord

    left_out = [
        QuarantinedRecord(3, "r3", "too_short", "2 loss tokens"),
        QuarantinedRecord(5, None, "bad_json"),
        QuarantinedRecord(8, "r8", "too_short", "1 loss token"),
    ]
    builders.random_store(tmp_path / "s", num_shards=1, quarantined=left_out)
    assert cli(["info", str(tmp_path / "s")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "quarantined  3 record(s) left out by the plan: too_short 2, bad_json 1" in lines, lines
    # Issue 62.5: the first records of each reason (1-based record numbers), and where the rest are.
    assert (
        "             record 4: too_short: 2 loss tokens" in lines
        and "             record 9: too_short: 1 loss token" in lines
    )
    assert "             record 6: bad_json: " in lines
    assert f"             (all of them: python -m store_schema info {tmp_path / 's'} --quarantined)" in lines
    assert cli(["info", str(tmp_path / "s"), "--quarantined"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["record"], r["sample_id"], r["reason"]) for r in listed] == [
        (4, "r3", "too_short"),
        (6, None, "bad_json"),
        (9, "r8", "too_short"),
    ]
    assert cli(["info", str(tmp_path / "s"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined"] == {"too_short": 2, "bad_json": 1}
    builders.random_store(tmp_path / "clean", num_shards=1)
    assert cli(["info", str(tmp_path / "clean")]) == 0
    assert not any(line.startswith("quarantined") for line in capsys.readouterr().out.splitlines())


def test_creating_a_store_keeps_the_jobs_held_lock(tmp_path):
    """A job locks STORE/.lock before it creates the store; creating (or overwriting)
    it must not delete that file, else a second job locks a fresh inode beside it."""
    from store_schema import StoreLock, StoreLockedError

    path = tmp_path / "s"
    fingerprint = Fingerprint(
        target_model="m", num_target_layers=6, hidden_size=64, vocab_size=512, layer_ids=[1], max_length=16
    )
    with StoreLock(path):
        inode = (path / ".lock").stat().st_ino
        create_store(path, fingerprint)
        create_store(path, fingerprint, overwrite=True)
        assert (path / ".lock").stat().st_ino == inode
        with pytest.raises(StoreLockedError):
            StoreLock(path).acquire()


def test_cli_names_a_damaged_root_or_a_held_store_with_exit_1(tmp_path, capsys):
    """Input that exists but is wrong exits 1 (store_schema.runtime.cli): `verify` reports a
    store root that is no longer JSON as a problem naming zarr.json, like any other
    damaged file; `info` refuses it in one line; `--clean` is refused while a live
    job holds the store."""
    builders.random_store(tmp_path / "s", num_shards=1)
    root = tmp_path / "s" / "zarr.json"
    original = root.read_bytes()
    root.write_bytes(b"\x00" + original[1:])
    assert cli(["verify", str(tmp_path / "s"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["file"] for p in report["problems"]] == ["zarr.json"] and "not a dflash store root" in report["problems"][
        0
    ]["what"]
    assert cli(["info", str(tmp_path / "s")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "zarr.json: not a dflash store root" in error and error.count("\n") == 1
    root.write_bytes(original)

    with StoreLock(tmp_path / "s", job="extract"):
        assert cli(["verify", str(tmp_path / "s"), "--clean"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and "held by another live job" in error
    assert cli(["verify", str(tmp_path / "s"), "--clean"]) == 0


@pytest.mark.slow  # child processes
def test_cli_help_does_not_import_torch():
    """`--help` and usage errors answer without loading torch (the handlers import the reader)."""
    script = (
        "import sys; from store_schema.__main__ import main; "
        "codes = [main(['--help']), main(['verify'])]; print(codes, 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=REPO)
    assert result.stdout.strip().splitlines()[-1] == "[0, 2] False", result.stdout + result.stderr
