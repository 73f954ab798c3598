"""The opt-in fp8 store (`--store-dtype fp8_e4m3`): per-token power-of-two scales that
never saturate, NaN/Inf refused at write, states within e4m3 rounding of bf16, and
verify, info, the loader, the trainer and eval on an fp8 store; one store never
mixes dtypes."""

from __future__ import annotations

import json
from functools import partial

import builders
import numpy as np
import pytest
import stores
import tiny
import torch
import zarr
from builders import fp8_rounding_bound as rounding_bound

from store_schema import (
    Fingerprint,
    FingerprintMismatch,
    NonFiniteStatesError,
    SampleArrays,
    Store,
    create_store,
    layout,
)
from store_schema.__main__ import main as store_cli
from store_schema.codecs.fp8 import E4M3_MAX, LARGEST_STORABLE, dequantize, quantize
from store_schema.dtypes import QuantizedStates
from store_schema.tools.verify import verify_store
from train.families.dflash.anchors import has_anchor

BF16_MAX = float(torch.finfo(torch.bfloat16).max)
BF16_TINY = float(torch.finfo(torch.bfloat16).smallest_normal)


def _rows() -> torch.Tensor:
    """Rows at the edges of the scale rule, as bf16 [rows, 64]."""
    rng = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 64, generator=rng)
    rows[0] = 0.0  # all zeros
    rows[1, :3] = torch.tensor([E4M3_MAX, -E4M3_MAX, 1.0])  # exactly at e4m3's max
    rows[2] *= 1000.0 / rows[2].abs().max()
    rows[2, 7] = 2 * E4M3_MAX  # a power of two times the max
    rows[3] *= 0.01
    rows[3, 0] = E4M3_MAX + 1  # just above the max
    rows[4] = torch.randn(64, generator=rng) * BF16_TINY * 4  # subnormal-ish
    rows[5] = 0.0
    rows[5, 9] = BF16_TINY / 64  # one bf16 subnormal, the rest zero
    rows[6] = torch.randn(64, generator=rng).clamp(-4, 4) * (LARGEST_STORABLE / 8)  # near bf16's max
    rows[6, 0] = LARGEST_STORABLE - 2.0**120  # the largest bf16 value e4m3 holds without rounding to Inf
    rows[7, 5] = 3000.0  # a massive activation among ordinary values
    return rows.to(torch.bfloat16)


def test_scales_never_saturate_and_states_stay_within_e4m3_rounding():
    states = _rows()
    codes, scales = quantize(states)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    bits = codes.view(torch.uint8)
    assert not bool(((bits & 0x7F) == 0x7F).any()), "a NaN code: a value saturated"
    assert float(codes.float().abs().max()) <= E4M3_MAX
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all()) and bool((scales > 0).all()), "scales are positive powers of two"
    amax = states.float().abs().amax(dim=1)
    nonzero = amax > 0
    # the smallest such power of two, except where clamped to keep scales normal float32
    tightest = (amax / (scales / 2) > E4M3_MAX) | (scales == 2.0**-126)
    assert bool(tightest[nonzero].all())
    reference = states.float()
    restored = dequantize(codes, scales, torch.float32)
    assert bool(((restored - reference).abs() <= rounding_bound(reference, scales)).all())
    assert torch.equal(dequantize(codes, scales).float(), restored), "dequantizing to bf16 is exact"
    assert torch.equal(codes[0].float(), torch.zeros(64)) and float(scales[0]) == 1.0
    assert float(scales[1]) == 1.0 and float(codes[1, 0]) == E4M3_MAX


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -BF16_MAX])
def test_nan_and_inf_are_refused_at_write_and_nothing_is_committed(tmp_path, bad):
    fingerprint = Fingerprint(
        target_model="t",
        num_target_layers=6,
        hidden_size=64,
        vocab_size=512,
        layer_ids=[1, 3],
        max_length=512,
        dtype="fp8_e4m3",
    )
    writer = create_store(tmp_path / "s", fingerprint)
    good = torch.randn(20, 64).to(torch.bfloat16)
    broken = good.clone()
    broken[13, 40] = bad
    ids = np.zeros(20, np.int32)
    sample = SampleArrays("x", ids, np.ones(20, np.uint8), {1: good, 3: broken})
    with pytest.raises(NonFiniteStatesError, match=r"sample 'x' layer 3: NaN/Inf .* 1 token\(s\), first at token 13"):
        writer.write_shard("shard-000000", [sample])
    assert not Store(tmp_path / "s").committed_shards()
    assert not any((tmp_path / "s" / layout.STAGING_DIR).iterdir())


def test_fingerprint_refuses_mixing_dtypes_and_unknown_ones(tmp_path):
    base = dict(target_model="t", num_target_layers=6, hidden_size=64, vocab_size=512, layer_ids=[1, 3], max_length=512)
    fp8 = Fingerprint(**base, dtype="fp8_e4m3")
    with pytest.raises(FingerprintMismatch, match="dtype: store has 'fp8_e4m3', expected 'bfloat16'"):
        fp8.check(Fingerprint(**base))
    with pytest.raises(ValueError, match="unknown store dtype 'float16'; choose one of bfloat16, fp8_e4m3"):
        Fingerprint(**base, dtype="float16")
    writer = create_store(tmp_path / "bf16", Fingerprint(**base))
    codes, scales = quantize(torch.randn(5, 64))
    sample = SampleArrays(
        "x",
        np.zeros(5, np.int32),
        np.ones(5, np.uint8),
        {1: QuantizedStates(codes, scales), 3: QuantizedStates(codes, scales)},
    )
    with pytest.raises(ValueError, match="sample 'x' layer 1: quantized states offered to a bfloat16 store"):
        writer.write_shard("shard-000000", [sample])


@pytest.fixture(scope="module")
def twin_stores(tmp_path_factory, qwen3_dir, tokenizer):
    return stores.twin_stores(tmp_path_factory.mktemp("twins"), qwen3_dir, tokenizer, "fp8_e4m3")


def test_fp8_store_holds_the_bf16_states_within_rounding_and_verifies(twin_stores, capsys):
    bf16_path, fp8_path = twin_stores
    bf16, fp8 = Store(bf16_path), Store(fp8_path)
    assert fp8.fingerprint.dtype == "fp8_e4m3" and fp8.committed_shards() == bf16.committed_shards()
    for name in fp8.committed_shards():
        exact, coded = bf16.read_shard(name), fp8.read_shard(name)
        assert set(coded.scales) == {1, 3}
        for layer in (1, 3):
            assert coded.hidden[layer].dtype == torch.float8_e4m3fn
            reference = exact.hidden[layer].float()
            restored = coded.sample(0).hidden[layer]  # Sample: always bf16
            assert restored.dtype == torch.bfloat16
            full = coded.states(layer).float()
            assert bool(((full - reference).abs() <= rounding_bound(reference, coded.scales[layer])).all())
            n = int(coded.offsets[1])
            assert torch.equal(restored.float(), full[:n])
            window = fp8.read_window(name, 0, 2, n - 1, [layer]).hidden[layer]
            assert torch.equal(window, restored[2 : n - 1])
        group = zarr.open_group(str(layout.shard_dir(fp8_path, name)), mode="r")  # plain zarr-python
        assert str(group[layout.layer_array(1)].dtype) == "float8_e4m3fn"
        assert np.array_equal(group[layout.scale_array(1)][...], coded.scales[1].numpy())
    assert verify_store(fp8_path).ok
    assert store_cli(["info", str(fp8_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "fp8_e4m3" and info["codec"]["name"] == "channels"
    assert store_cli(["info", str(fp8_path)]) == 0
    assert "codec        channels (zstd level 1, 16-byte-wide chunks of <= 128 tokens)" in capsys.readouterr().out
    layer_bytes = {p: sum(f.stat().st_size for f in p.glob("shards/*/layer_*/c/0/0")) for p in (bf16_path, fp8_path)}
    assert layer_bytes[fp8_path] < 0.78 * layer_bytes[bf16_path]  # 0.76: the bf16 store uses the small match table


def test_verify_names_nan_codes_and_bad_scales_in_an_fp8_store(tmp_path):
    """What the writer never makes (it refuses NaN input) verify still finds: a NaN
    code (0x7f) and a scale that is not a positive power of two."""
    fingerprint = Fingerprint(
        target_model="t",
        num_target_layers=6,
        hidden_size=64,
        vocab_size=512,
        layer_ids=[1, 3],
        max_length=512,
        dtype="fp8_e4m3",
    )
    writer = create_store(tmp_path / "s", fingerprint)
    codes, scales = quantize(torch.randn(10, 64))
    bad_codes = codes.clone()
    bad_codes.view(torch.uint8)[4, 17] = 0x7F
    bad_scales = scales.clone()
    bad_scales[6] = 3.0
    writer.write_shard(
        "shard-000000",
        [
            SampleArrays(
                "x",
                np.zeros(10, np.int32),
                np.ones(10, np.uint8),
                {1: QuantizedStates(bad_codes, scales), 3: QuantizedStates(codes, bad_scales)},
            )
        ],
    )
    problems = {(p["array"], p["what"]) for p in verify_store(tmp_path / "s").problems}
    assert problems == {
        ("layer_1", "1 token(s) with NaN/Inf, first at token 4"),
        ("layer_3_scale", "1 scale(s) not a positive power of two, first at token 6"),
    }


def test_loader_trainer_and_eval_on_an_fp8_store(twin_stores, qwen3_dir, tmp_path, capsys):
    from train.cli import main as train_cli
    from train.config_loading import load_config
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader
    from train.fitting.trainer import Trainer

    _, fp8_path = twin_stores
    store = Store(fp8_path)
    loader = ShardLoader(
        store, DataConfig(heldout_fraction=0.0), LoaderSpec([1, 3], partial(has_anchor, 8), seed=0, epochs=1)
    )
    sample = next(iter(loader))
    loader.close()
    assert [f.dtype for f in sample.features] == [torch.float8_e4m3fn] * 2 and len(sample.scales) == 2
    data = store.read_shard(sample.shard)
    index = data.sample_ids.index(sample.sample_id)
    start = int(data.offsets[index])
    expected = torch.cat([data.states(layer, start, start + sample.num_tokens) for layer in (1, 3)], dim=-1)
    assert torch.equal(sample.context_features(), expected)

    out = tmp_path / "run"
    config = load_config(
        None,
        tiny.drafter_sets("model.num_anchors=16", "data.heldout_fraction=0.25", "eval.every=0", "train.max_steps=4"),
        store=str(fp8_path),
        target=str(qwen3_dir),
        out=str(out),
    )
    record = Trainer.from_config(config, log=lambda m: None).fit()
    assert np.isfinite(record["loss"])
    assert train_cli(["export", str(out), "--out", str(tmp_path / "drafter")]) == 0
    capsys.readouterr()
    assert (
        train_cli(
            [
                "eval",
                "--store",
                str(fp8_path),
                "--drafter",
                str(tmp_path / "drafter"),
                "--target",
                str(qwen3_dir),
                "--ddtree-budgets",
                "4",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] > 0 and result["tau"] >= 1.0


def test_plain_zarr_reads_an_fp8_store_as_written(tmp_path):
    _, shards = builders.random_store(tmp_path / "s", num_shards=1, dtype="fp8_e4m3")
    store = Store(tmp_path / "s")
    data = store.read_shard("shard-000000")
    group = zarr.open_group(str(layout.shard_dir(store.path, "shard-000000")), mode="r")
    for layer in (1, 3):
        written = torch.cat([s.hidden[layer] for s in shards["shard-000000"]])
        codes, scales = quantize(written)
        assert np.array_equal(group[layout.layer_array(layer)][...].view(np.uint8), codes.view(torch.uint8).numpy())
        assert np.array_equal(group[layout.scale_array(layer)][...], scales.numpy())
        assert torch.equal(data.hidden[layer].view(torch.uint8), codes.view(torch.uint8))
