"""`verify --recompute`: stored states are re-derived with plain transformers."""

from __future__ import annotations

import json

import builders
import numpy as np

from extract.extraction.runner import TargetRunner
from extract.jobs.target import load_target
from store_schema import CodecConfig, Fingerprint, SampleArrays, create_store
from store_schema.__main__ import main as cli


def _store_from(model_dir, path, layer_ids=(1, 4)):
    target = load_target(model_dir)
    runner = TargetRunner(target, layer_ids)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 500, n).astype(np.int32) for n in (40, 70, 55)]
    outputs = runner.run_batch(sequences)
    fingerprint = Fingerprint(
        target_model=str(model_dir),
        num_target_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        layer_ids=layer_ids,
        max_length=128,
    )
    writer = create_store(path, fingerprint, CodecConfig(chunk_bytes=2048))
    writer.write_shard(
        "shard-000000",
        [
            SampleArrays(f"r{i}", ids, np.ones(len(ids), np.uint8), {layer: out[layer] for layer in layer_ids})
            for i, (ids, out) in enumerate(zip(sequences, outputs))
        ],
    )


def test_recompute_agrees_with_the_model_and_not_with_another(tmp_path, qwen3_5_dir, capsys):
    _store_from(qwen3_5_dir, tmp_path / "s")
    assert cli(["verify", str(tmp_path / "s"), "--recompute", "2", "--model", str(qwen3_5_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(report["recomputed"]) == 2
    assert all(c >= 0.999 for entry in report["recomputed"] for c in entry["min_cosine"].values())

    other = tmp_path / "other"
    builders.build_model(other, kind="qwen3_5", vocab_size=512, seed=1)
    assert cli(["verify", str(tmp_path / "s"), "--recompute", "2", "--model", str(other), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["problems"] and all("recomputed cosine" in p["what"] for p in report["problems"])
    question = report["problems"][0]["what"]  # asked first: the cosines are far too low for numerics
    assert question.startswith("worst recomputed cosine ") and f"is --model {other} the checkpoint" in question
    assert question.endswith(f"extracted from ({qwen3_5_dir})?"), question  # this store recorded no hashes


def test_recompute_of_a_projected_store_compares_on_its_kept_directions(tmp_path, qwen3_5_dir, capsys):
    """A projected store promises the states on its kept directions: that is what the
    fresh states are compared with (the raw ones would fail any bar at rank 32 of 64)."""
    _store_from(qwen3_5_dir, tmp_path / "s")
    assert cli(["project", str(tmp_path / "s"), "--out", str(tmp_path / "p"), "--rank", "32", "--json"]) == 0
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "p"), "--recompute", "2", "--model", str(qwen3_5_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(c >= 0.999 for entry in report["recomputed"] for c in entry["min_cosine"].values())


def test_recompute_needs_a_model(tmp_path):
    builders.random_store(tmp_path / "s", num_shards=1)
    assert cli(["verify", str(tmp_path / "s"), "--recompute", "2"]) == 2
