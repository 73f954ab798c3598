"""A projected store (`python -m store_schema project`): directions fitted on the
states' second moment, one rank for every layer rounded to whole fp4 blocks, the directions kept in the
store under the fingerprint's digest, coordinates stored (bf16 or lossy) and lifted
back by every reader; verify names a projection file that is not the recorded one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from store_schema import Fingerprint, SampleArrays, Store, create_store
from store_schema.__main__ import main as store_cli
from store_schema.projection import RANK_MULTIPLE, Projection, fit, fold, lift, project, second_moment
from store_schema.tools.verify import verify_store

RANK, OTHER_RANK, HIDDEN = 12, 40, 128


def _states(generator, tokens: int, rank: int | None) -> torch.Tensor:
    if rank is None:
        return torch.randn(tokens, HIDDEN, generator=generator)
    basis = torch.randn(rank, HIDDEN, generator=torch.Generator().manual_seed(7))
    return torch.randn(tokens, rank, generator=generator) @ basis


def test_fit_keeps_the_energy_asked_in_whole_blocks_and_fold_is_lift():
    generator = torch.Generator().manual_seed(0)
    low, other, full = (_states(generator, 2000, r) for r in (RANK, OTHER_RANK, None))
    projection = fit({1: second_moment(low), 3: second_moment(other)}, 2000, energy=0.99)
    assert projection.rank(1) == projection.rank(3) == 2 * RANK_MULTIPLE, "one rank: layer 3's 40, rounded up"
    assert projection.energy_kept[1] > 1 - 1e-9 and projection.energy_kept[3] > 1 - 1e-9
    assert not fit({1: second_moment(low), 3: second_moment(full)}, 2000, energy=0.99).directions, (
        "isotropic states would keep all 128: nothing is projected"
    )
    p = torch.from_numpy(projection.directions[1])
    assert torch.allclose(p.T @ p, torch.eye(2 * RANK_MULTIPLE), atol=1e-5), "orthonormal"
    restored = lift(project(low.bfloat16(), p), p).float()
    assert float((restored - low).norm() / low.norm()) < 0.01, "states in the kept subspace come back"
    assert fit({1: second_moment(full)}, 2000, rank=40).rank(1) == 64
    with pytest.raises(ValueError, match="either an energy share or a rank"):
        fit({1: second_moment(full)}, 2000)

    weight = torch.randn(16, 2 * HIDDEN, dtype=torch.float64)
    raw = torch.randn(5, 2 * HIDDEN, dtype=torch.float64)
    lifted = torch.cat([raw[:, :HIDDEN] @ p.double() @ p.double().T, raw[:, HIDDEN:]], dim=1)
    assert torch.allclose(raw @ fold(weight, [p, None]).T, lifted @ weight.T, atol=1e-10)

    again = Projection.from_bytes(projection.to_bytes(), "test")
    assert again.summary() == projection.summary() and np.array_equal(again.directions[1], projection.directions[1])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A bf16 store whose layer 1 spans `RANK` directions and layer 3 `OTHER_RANK`."""
    path = tmp_path_factory.mktemp("projection") / "bf16"
    fingerprint = Fingerprint(
        target_model="t", num_target_layers=6, hidden_size=HIDDEN, vocab_size=64, layer_ids=[1, 3], max_length=512
    )
    writer = create_store(path, fingerprint)
    generator = torch.Generator().manual_seed(1)
    for shard in range(2):
        samples = [
            SampleArrays(
                f"s{shard}-{i}",
                np.arange(150, dtype=np.int32) % 64,
                np.ones(150, np.uint8),
                {1: _states(generator, 150, RANK).bfloat16(), 3: _states(generator, 150, OTHER_RANK).bfloat16()},
            )
            for i in range(3)
        ]
        writer.write_shard(f"shard-{shard:06d}", samples)
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "fp4_e2m1"])
def test_project_writes_coordinates_every_reader_lifts(source, tmp_path, capsys, dtype):
    out = tmp_path / "projected"
    assert store_cli(["project", str(source), "--out", str(out), "--energy", "0.999", "--store-dtype", dtype]) == 0
    capsys.readouterr()
    exact, projected = Store(source), Store(out)
    recorded = projected.fingerprint.projection
    assert projected.fingerprint.dtype == dtype and recorded["ranks"] == {"1": 64, "3": 64}
    assert projected.committed_shards() == exact.committed_shards() and verify_store(out).ok
    tolerance = {"bfloat16": 0.02, "fp4_e2m1": 0.2}[dtype]
    for name in exact.committed_shards():
        want, got = exact.read_shard(name), projected.read_shard(name)
        assert got.hidden[1].shape[1] == projected.dtype.stored_columns(64)
        for layer in (1, 3):
            error = (got.states(layer).float() - want.states(layer).float()).norm() / want.states(layer).float().norm()
            assert float(error) < tolerance, (name, layer, float(error))
        window = projected.read_window(name, 1, 3, 40, [1]).hidden[1]
        start = int(got.offsets[1])
        assert torch.equal(window, got.states(1, start + 3, start + 40))
    assert store_cli(["info", str(out)]) == 0
    assert f"projection   layer 1: 64 of {HIDDEN}" in capsys.readouterr().out


def test_verify_names_a_projection_file_that_is_not_the_recorded_one(source, tmp_path):
    out = tmp_path / "projected"
    assert store_cli(["project", str(source), "--out", str(out), "--rank", "32", "--json"]) == 0
    other = fit({1: np.eye(HIDDEN), 3: np.eye(HIDDEN)}, 1, rank=32)
    (out / "projection.safetensors").write_bytes(other.to_bytes())
    problems = {(p.get("file"), p["what"]) for p in verify_store(out).problems}
    assert any(
        file == "projection.safetensors" and "differs from the one the fingerprint records" in what
        for file, what in problems
    ), problems
    with pytest.raises(ValueError, match="differs from the one the fingerprint records"):
        Store(out).read_shard("shard-000000").states(1)


def test_a_store_already_rounded_is_not_projected(source, tmp_path, capsys):
    lossy = tmp_path / "fp8"
    assert store_cli(["project", str(source), "--out", str(lossy), "--rank", "32", "--store-dtype", "fp8_e4m3"]) == 0
    assert store_cli(["project", str(lossy), "--out", str(tmp_path / "again"), "--rank", "32"]) != 0
    assert "a projection is fitted on exact states" in capsys.readouterr().err
    assert json.loads(json.dumps(Store(lossy).fingerprint.projection))["ranks"] == {"1": 32, "3": 32}
