"""The opt-in 4-bit store (`--store-dtype fp4_e2m1`): e2m1 codes exactly as ml_dtypes
rounds them, block scales that never saturate, NaN/Inf refused at write, states
within e2m1 rounding of bf16, and verify, info, plain zarr, the loader, the trainer
and eval on an fp4 store."""

from __future__ import annotations

import json
from functools import partial

import ml_dtypes
import numpy as np
import pytest
import stores
import tiny
import torch
import zarr
from builders import fp4_rounding_bound as rounding_bound

from store_schema import NonFiniteStatesError, SampleArrays, Store, create_store, layout
from store_schema.__main__ import main as store_cli
from store_schema.codecs.fp4 import (
    BLOCK,
    E2M1_MAX,
    NAN_SCALE,
    SCALE_BIAS,
    bad_scale_tokens,
    dequantize,
    float32,
    quantize,
)
from store_schema.dtypes import FP4_E2M1_STORE, QuantizedStates
from store_schema.fingerprint import Fingerprint
from store_schema.tools.verify import verify_store
from train.families.dflash.anchors import has_anchor


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(exponents.shape), exponents.float())


def _rows() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    rows = (torch.randn(200, 256, generator=generator) * torch.logspace(-4, 4, 256)).to(torch.bfloat16)
    rows[0] = 0.0
    rows[1, :BLOCK] = 1.0
    rows[1, 0] = 3.0  # amax 3: scale 2^-1, codes 6 and 2
    rows[2, :BLOCK] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75] + [0.0] * 22 + [6.0])
    return rows


def test_codes_round_as_ml_dtypes_and_scales_never_saturate():
    states = _rows()
    codes, scales = quantize(states)
    assert codes.shape == (200, 128) and codes.dtype == torch.uint8
    assert scales.shape == (200, 256 // BLOCK) and scales.dtype == torch.uint8
    exponents = scales.int() - SCALE_BIAS
    reference = states.float()
    blocks = reference.unflatten(-1, (-1, BLOCK))
    divided = torch.ldexp(blocks, -exponents[..., None].float()).flatten(-2).numpy()
    expected = divided.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)  # ml_dtypes: nearest, ties to even
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).numpy()
    assert np.array_equal(nibbles, expected)
    amax = blocks.abs().amax(dim=-1)
    assert bool((amax <= E2M1_MAX * _pow2(exponents)).all()), "no value saturates"
    nonzero = amax > 0
    assert bool((amax[nonzero] > E2M1_MAX * _pow2(exponents[nonzero] - 1)).all()), "tightest"
    restored = dequantize(codes, scales, torch.float32)
    assert bool(((restored - reference).abs() <= rounding_bound(reference, scales)).all())
    assert torch.equal(dequantize(codes, scales).float(), restored), "dequantizing to bf16 is exact"
    assert np.array_equal(float32(codes.numpy(), scales.numpy()), restored.numpy()), "numpy twin"
    assert torch.equal(restored[0], torch.zeros(256)) and torch.equal(restored[1, :BLOCK], reference[1, :BLOCK])
    assert restored[2, :9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0]


def _fingerprint(**overrides) -> Fingerprint:
    base = dict(target_model="t", num_target_layers=6, hidden_size=64, vocab_size=512, layer_ids=[1, 3], max_length=512)
    return Fingerprint(**{**base, "dtype": "fp4_e2m1", **overrides})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_at_write_and_nothing_is_committed(tmp_path, bad):
    writer = create_store(tmp_path / "s", _fingerprint())
    good = torch.randn(20, 64).to(torch.bfloat16)
    broken = good.clone()
    broken[13, 40] = bad
    sample = SampleArrays("x", np.zeros(20, np.int32), np.ones(20, np.uint8), {1: good, 3: broken})
    with pytest.raises(NonFiniteStatesError, match=r"sample 'x' layer 3: NaN/Inf .* 1 token\(s\), first at token 13"):
        writer.write_shard("shard-000000", [sample])
    assert not Store(tmp_path / "s").committed_shards()


def test_a_hidden_size_off_the_block_and_fp8_codes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="an fp4 store needs a hidden size divisible by 32, got 48"):
        quantize(torch.randn(2, 48))
    writer = create_store(tmp_path / "s", _fingerprint())
    codes, scales = FP4_E2M1_STORE.lossy.quantize(torch.randn(5, 64))
    fp8 = QuantizedStates(torch.zeros(5, 64, dtype=torch.float8_e4m3fn), torch.ones(5))
    sample = SampleArrays(
        "x", np.zeros(5, np.int32), np.ones(5, np.uint8), {1: fp8, 3: QuantizedStates(codes, scales, 2)}
    )
    with pytest.raises(
        ValueError, match="sample 'x' layer 1: states quantized as torch.float8_e4m3fn offered to a fp4"
    ):
        writer.write_shard("shard-000000", [sample])


def test_codes_quantized_elsewhere_with_a_nan_block_scale_are_refused(tmp_path):
    """Codes quantized on a device carry NaN/Inf as a NaN block scale (every other
    exponent byte is a valid scale): the writer refuses them as it refuses NaN states,
    and verify's rule for stored scales is the same test."""
    writer = create_store(tmp_path / "s", _fingerprint())
    states = torch.randn(10, 64)
    states[6, 40] = float("nan")
    codes, scales = quantize(states)
    assert bad_scale_tokens(scales.numpy()).tolist() == [6] and int(scales[6, 1]) == NAN_SCALE
    quantized = {1: QuantizedStates(*quantize(torch.randn(10, 64)), 2), 3: QuantizedStates(codes, scales, 2)}
    sample = SampleArrays("x", np.zeros(10, np.int32), np.ones(10, np.uint8), quantized)
    with pytest.raises(NonFiniteStatesError, match="sample 'x' layer 3: NaN/Inf .* first at token 6"):
        writer.write_shard("shard-000000", [sample])


@pytest.fixture(scope="module")
def twin_stores(tmp_path_factory, qwen3_dir, tokenizer):
    return stores.twin_stores(tmp_path_factory.mktemp("twins"), qwen3_dir, tokenizer, "fp4_e2m1")


def test_fp4_store_holds_the_bf16_states_within_rounding_and_verifies(twin_stores, capsys):
    bf16_path, fp4_path = twin_stores
    bf16, fp4 = Store(bf16_path), Store(fp4_path)
    assert fp4.fingerprint.dtype == "fp4_e2m1" and fp4.committed_shards() == bf16.committed_shards()
    for name in fp4.committed_shards():
        exact, coded = bf16.read_shard(name), fp4.read_shard(name)
        for layer in (1, 3):
            assert coded.hidden[layer].dtype == torch.uint8 and coded.scales[layer].dtype == torch.uint8
            reference = exact.hidden[layer].float()
            full = coded.states(layer).float()
            assert bool(((full - reference).abs() <= rounding_bound(reference, coded.scales[layer])).all())
            n = int(coded.offsets[1])
            assert torch.equal(coded.sample(0).hidden[layer].float(), full[:n])
            window = fp4.read_window(name, 0, 2, n - 1, [layer]).hidden[layer]
            assert torch.equal(window.float(), full[2 : n - 1])
        group = zarr.open_group(str(layout.shard_dir(fp4_path, name)), mode="r")  # plain zarr-python
        assert np.array_equal(group[layout.layer_array(1)][...], coded.hidden[1].numpy())
        assert np.array_equal(group[layout.scale_array(1)][...], coded.scales[1].numpy())
    assert verify_store(fp4_path).ok
    assert store_cli(["info", str(fp4_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "fp4_e2m1"
    layer_bytes = {p: sum(f.stat().st_size for f in p.glob("shards/*/layer_*/c/0/0")) for p in (bf16_path, fp4_path)}
    assert layer_bytes[fp4_path] < 0.45 * layer_bytes[bf16_path]


def test_loader_and_trainer_on_an_fp4_store(twin_stores, qwen3_dir, tmp_path):
    from train.config_loading import load_config
    from train.data.config import DataConfig
    from train.data.loader import LoaderSpec, ShardLoader
    from train.fitting.trainer import Trainer

    _, fp4_path = twin_stores
    store = Store(fp4_path)
    loader = ShardLoader(
        store, DataConfig(heldout_fraction=0.0), LoaderSpec([1, 3], partial(has_anchor, 8), seed=0, epochs=1)
    )
    sample = next(iter(loader))
    loader.close()
    assert [f.dtype for f in sample.features] == [torch.uint8] * 2 and len(sample.scales) == 2
    data = store.read_shard(sample.shard)
    start = int(data.offsets[data.sample_ids.index(sample.sample_id)])
    expected = torch.cat([data.states(layer, start, start + sample.num_tokens) for layer in (1, 3)], dim=-1)
    assert torch.equal(sample.context_features(), expected)
    config = load_config(
        None,
        tiny.drafter_sets("model.num_anchors=16", "data.heldout_fraction=0.25", "eval.every=0", "train.max_steps=4"),
        store=str(fp4_path),
        target=str(qwen3_dir),
        out=str(tmp_path / "run"),
    )
    assert np.isfinite(Trainer.from_config(config, log=lambda m: None).fit()["loss"])
