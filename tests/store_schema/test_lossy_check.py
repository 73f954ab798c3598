"""`python -m store_schema lossy STORE`: each lossy dtype's error on a bf16 store's
own states and the rank their energy needs, checked against states whose rank and
rounding are known; a store already rounded is refused."""

from __future__ import annotations

import json

import builders
import numpy as np
import torch

from store_schema import Fingerprint, SampleArrays, create_store
from store_schema.__main__ import main as store_cli

RANK, HIDDEN = 12, 128


def _low_rank_store(path):
    """A bf16 store whose layer-1 states span exactly `RANK` directions and whose
    layer-3 states fill all `HIDDEN`."""
    generator = torch.Generator().manual_seed(0)
    basis = torch.randn(RANK, HIDDEN, generator=generator)
    fingerprint = Fingerprint(
        target_model="t", num_target_layers=6, hidden_size=HIDDEN, vocab_size=64, layer_ids=[1, 3], max_length=512
    )
    writer = create_store(path, fingerprint)
    samples = []
    for index in range(4):
        low = (torch.randn(200, RANK, generator=generator) @ basis).to(torch.bfloat16)
        full = torch.randn(200, HIDDEN, generator=generator).to(torch.bfloat16)
        ids = np.zeros(200, np.int32)
        samples.append(SampleArrays(f"s{index}", ids, np.ones(200, np.uint8), {1: low, 3: full}))
    writer.write_shard("shard-000000", samples)
    return path


def test_rank_and_rounding_of_known_states(tmp_path, capsys):
    store = _low_rank_store(tmp_path / "s")
    assert store_cli(["lossy", str(store), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    low, full = report["layers"]
    assert (low["layer_id"], low["tokens"], low["hidden"]) == (1, 800, HIDDEN)
    assert low["directions"]["0.999"] <= RANK, "bf16 rounding adds energy far below 0.1 %"
    assert full["directions"]["0.9"] > 4 * RANK, "isotropic states need most directions"
    for layer in (low, full):
        fp8, fp4 = layer["errors"]["fp8_e4m3"], layer["errors"]["fp4_e2m1"]
        assert 0.01 < fp8["relative_rms"] < 0.04 and 0.08 < fp4["relative_rms"] < 0.16
        assert fp4["worst_token_cosine"] < fp8["worst_token_cosine"] < 1.0
    assert report["size_ratio"]["fp4_e2m1"] < report["size_ratio"]["fp8_e4m3"] < report["size_ratio"]["bfloat16"]
    assert store_cli(["lossy", str(store), "--tokens", "300"]) == 0
    text = capsys.readouterr().out
    assert "layer   1  300 tokens  fp8_e4m3" in text and f"of {HIDDEN} directions" in text


def test_a_lossy_store_is_refused_naming_its_dtype(tmp_path, capsys):
    builders.random_store(tmp_path / "s", num_shards=1, dtype="fp8_e4m3")
    assert store_cli(["lossy", str(tmp_path / "s")]) != 0
    assert "a fp8_e4m3 store holds its states already rounded" in capsys.readouterr().err
