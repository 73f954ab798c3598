"""Store codec v2 (`bytesplit`): standard blosc chunks whose high-byte stream is
zstd-coded and low-byte stream raw; codec v3 (`channels`, fp8's default): the same
chunks cut 16 bytes wide, one stream per channel. Both round trip bit for bit,
plain blosc and zarr-python decode them, stores written with the v1 codec still
read and verify."""

from __future__ import annotations

import json
import struct

import builders
import numpy as np
import pytest
import stores
import torch
import zarr
from numcodecs import blosc

from store_schema import CodecConfig, Fingerprint, SampleArrays, Store, create_store, layout, on_disk_bytes
from store_schema.codecs.arrays import RowBlocks
from store_schema.codecs.encoding import encode_bytesplit_chunk
from store_schema.commit.records import describe_files, write_record
from store_schema.tools.verify import verify_store


def _streams(chunk: bytes) -> list[int]:
    """Stored sizes of the streams of a one-block blosc1 chunk."""
    _, _, flags, typesize, nbytes, _, _ = struct.unpack("<BBBBiii", chunk[:16])
    streams = typesize if not flags & 0x10 else 1
    sizes, offset = [], 20
    for _ in range(streams):
        (size,) = struct.unpack("<i", chunk[offset : offset + 4])
        sizes.append(size)
        offset += 4 + size
    assert offset == len(chunk)
    return sizes


def _fp8_fingerprint() -> Fingerprint:
    """One 64-wide layer of a 4-layer target, stored as fp8."""
    return Fingerprint(
        target_model="t",
        num_target_layers=4,
        hidden_size=64,
        vocab_size=512,
        layer_ids=[1],
        max_length=512,
        dtype="fp8_e4m3",
    )


def test_every_bf16_pattern_round_trips_through_plain_blosc():
    """All 65,536 bf16 bit patterns (NaN payloads, Inf, subnormals, -0), encoded by the
    bytesplit encoder, decode bit for bit with plain numcodecs blosc (no store_schema code)."""
    bits = np.arange(2**16, dtype=np.uint16).reshape(256, 256)
    for min_saving in (0.0, 0.1, 0.99):
        chunk = encode_bytesplit_chunk(bits, level=1, min_saving=min_saving)
        out = np.empty_like(bits)
        blosc.decompress(chunk, out)
        assert np.array_equal(out, bits)


@pytest.mark.parametrize("min_saving", [0.0, 0.1, 0.99])
def test_every_bit_pattern_round_trips_through_plain_blosc_in_channel_streams(min_saving):
    """`channels` chunks (16-byte elements, a stream per channel byte): every fp8 code
    and every bf16 pattern, encoded here, decode bit for bit with plain blosc."""
    for bits in (
        np.arange(2**16, dtype=np.uint16).reshape(-1, 8),
        np.tile(np.arange(256, dtype=np.uint8), 64).reshape(-1, 16),
    ):
        chunk = encode_bytesplit_chunk(bits, level=1, min_saving=min_saving, typesize=16)
        assert len(_streams(chunk)) == 16
        out = np.empty_like(bits)
        blosc.decompress(chunk, out)
        assert np.array_equal(out, bits)


def test_fp8_stores_code_each_channel_apart_by_default(tmp_path):
    """States whose channels sit at different values (as real models' do): the
    default fp8 codec (`channels`) stores them in well under the bytes of the
    row-major one (~0.67 here), and both read back the same codes."""
    generator = torch.Generator().manual_seed(0)
    channel_mean = torch.linspace(-3, 3, 64)
    samples = [
        SampleArrays(
            f"s{i}",
            np.arange(300, dtype=np.int32),
            np.ones(300, np.uint8),
            {1: (torch.randn(300, 64, generator=generator) * 0.2 + channel_mean).to(torch.bfloat16)},
        )
        for i in range(4)
    ]
    codes = {}
    for name, codec in (("channels", None), ("bytesplit", CodecConfig())):
        create_store(tmp_path / name, _fp8_fingerprint(), codec).write_shard("shard-000000", samples)
        store = Store(tmp_path / name)
        assert store.codec.name == name
        codes[name] = (
            store.read_shard("shard-000000").hidden[1].view(torch.uint8),
            on_disk_bytes(tmp_path / name / "shards/shard-000000/layer_1"),
        )
    assert torch.equal(codes["channels"][0], codes["bytesplit"][0])
    assert codes["channels"][1] < 0.8 * codes["bytesplit"][1]


def test_activations_code_the_high_byte_and_store_the_low_byte_raw(qwen3_5_dir):
    """On real activations of the tiny Qwen3.5: the low byte (mantissa) is stored raw,
    the high byte (sign + exponent) coded to well under half its size; bit-exact."""
    from extract.extraction.runner import TargetRunner
    from extract.jobs.target import load_target

    runner = TargetRunner(load_target(qwen3_5_dir), [1, 5])
    ids = np.random.default_rng(0).integers(0, 500, 512).astype(np.int32)
    states = runner.run_batch([ids])[0][5]  # bf16 [512, 64]
    bits = states.view(torch.int16).numpy().view(np.uint16)
    chunk = encode_bytesplit_chunk(bits, level=1, min_saving=0.1)
    low, high = _streams(chunk)
    assert low == bits.size  # raw: a stream stored at its raw size is copied by every blosc decoder
    assert high < 0.5 * bits.size
    out = np.empty_like(bits)
    blosc.decompress(chunk, out)
    assert np.array_equal(out, bits)


def test_a_long_mantissa_stream_is_tried_on_its_head_and_stays_raw():
    """A stream longer than two trials: the mantissa byte of normal-distributed bf16
    values (nothing to gain) is stored raw without being coded whole, the exponent
    byte is coded; plain blosc decodes the chunk bit for bit."""
    from store_schema.codecs.encoding import TRIAL_BYTES

    states = torch.randn(4 * TRIAL_BYTES // 64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    bits = states.view(torch.int16).numpy().view(np.uint16)
    assert bits.size > 2 * TRIAL_BYTES
    low, high = _streams(encode_bytesplit_chunk(bits, level=1, min_saving=0.1))
    assert low == bits.size and high < 0.5 * bits.size
    out = np.empty_like(bits)
    blosc.decompress(encode_bytesplit_chunk(bits, level=1, min_saving=0.1), out)
    assert np.array_equal(out, bits)
    padded = bits.copy()  # a shard's last chunk: real rows, then zero padding
    padded[len(padded) // 4 :] = 0
    low, _ = _streams(encode_bytesplit_chunk(padded, level=1, min_saving=0.1))
    assert low < 0.5 * bits.size  # the trial looks past the head, where the zeros are


def test_channel_major_states_encode_to_the_same_shard_bytes():
    """A `channels` shard from states held channel-major (as fp8 codes leave the device)
    is byte for byte the shard from the same states row-major, for fp8 and bf16, with a
    zero-padded last row of chunks; its streams are cut without a transpose."""
    from store_schema.codecs.encoding import encode_shard

    rng = np.random.default_rng(3)
    codec = CodecConfig(name="channels", channel_rows=512)
    for values in (rng.integers(0, 256, (1201, 64), dtype=np.uint8), rng.integers(0, 2**16, (1201, 64), np.uint16)):
        rows, cols = codec.chunk_shape(*values.shape, values.itemsize)
        assert rows * -(-len(values) // rows) > len(values)  # the last row of chunks is padded
        channel_major = np.ascontiguousarray(values.T).T
        assert channel_major.strides[0] == values.itemsize
        from_channels = b"".join(encode_shard(channel_major, codec))  # joined now: parts point into scratch
        assert from_channels == b"".join(encode_shard(values, codec))


def test_a_layer_left_in_its_samples_blocks_encodes_to_the_joined_layers_bytes():
    """The writer hands a bf16 layer over as its samples' row blocks, unjoined
    (`RowBlocks`): a chunk inside one block is split from a view, one across blocks
    from the pieces joined; the shard is byte for byte the joined layer's, for
    `bytesplit` (whole rows a chunk) and `channels` (narrower chunks: joined first),
    with a padded last chunk; `take` gathers rows across blocks as numpy does."""
    from store_schema.codecs.encoding import encode_shard

    rng = np.random.default_rng(4)
    values = rng.integers(0, 2**16, (1201, 64), np.uint16)
    sizes = [1, 300, 77, 512, 311]  # block edges inside chunks and on them
    blocks = RowBlocks(np.split(values, np.cumsum(sizes)[:-1]))
    assert blocks.shape == values.shape and len(blocks) == 1201
    for codec in (CodecConfig(chunk_bytes=128 * 64 * 2), CodecConfig(name="channels", channel_rows=512)):
        assert b"".join(encode_shard(blocks, codec)) == b"".join(encode_shard(values, codec)), codec.name
    rows = np.array([0, 1, 2, 300, 301, 700, 1200, 5])
    assert np.array_equal(blocks.take(rows), values[rows])
    assert np.array_equal(blocks.rows(290, 900), values[290:900]) and np.array_equal(np.asarray(blocks), values)
    assert np.shares_memory(blocks.rows(2, 300), blocks.blocks[1])  # inside one block: a view, no copy
    with pytest.raises(ValueError, match="one width"):
        RowBlocks([values, values[:, :8]])


def _token_states(repeated: bool) -> torch.Tensor:
    """bf16 states [2048, 256]: each token's row one of 16 (states a token decides, as
    an early layer's: long repeated strings in the exponent stream), or all distinct."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(16 if repeated else 2048, 256, generator=generator)
    picks = torch.randint(0, 16, (2048,), generator=generator) if repeated else torch.arange(2048)
    return rows[picks].to(torch.bfloat16)


@pytest.mark.parametrize("repeated", [True, False], ids=["token-decided", "distinct"])
def test_the_match_finder_keeps_its_full_table_only_where_that_pays(tmp_path, repeated):
    """`match_table` auto codes a shard like `full` where the level's own table saves
    bytes (repeated strings) and like `small` where it does not; every setting
    reads back bit for bit through the store."""
    from store_schema.codecs.encoding import FULL_TABLE_SAVING, encode_shard

    bits = _token_states(repeated).view(torch.int16).numpy()
    shard = {
        table: b"".join(encode_shard(bits, CodecConfig(chunk_bytes=64 << 10, match_table=table)))
        for table in ("auto", "full", "small")
    }
    saves = 1 - len(shard["full"]) / len(shard["small"])
    assert (saves > 2 * FULL_TABLE_SAVING) if repeated else (saves < FULL_TABLE_SAVING / 2)
    assert shard["auto"] == shard["full" if repeated else "small"]
    fingerprint = Fingerprint(
        target_model="t", num_target_layers=4, hidden_size=256, vocab_size=512, layer_ids=[1], max_length=2048
    )
    sample = SampleArrays("s0", np.arange(2048, dtype=np.int32), np.ones(2048, np.uint8), {1: _token_states(repeated)})
    for table in ("full", "small"):
        create_store(tmp_path / table, fingerprint, CodecConfig(match_table=table)).write_shard(
            "shard-000000", [sample]
        )
        read = Store(tmp_path / table).read_shard("shard-000000").hidden[1]
        assert torch.equal(read.view(torch.int16), _token_states(repeated).view(torch.int16))


def test_an_fp8_writer_given_channel_major_codes_writes_the_row_major_store(tmp_path):
    """The writer keeps channel-major codes as they come (no transpose back): the shard
    files, layer statistics and commit record equal those of the same codes row-major."""
    from store_schema.codecs.fp8 import quantize
    from store_schema.dtypes import QuantizedStates

    generator = torch.Generator().manual_seed(2)
    states = [
        (torch.randn(n, 64, generator=generator) * torch.linspace(0.2, 3, 64)).to(torch.bfloat16) for n in (300, 401)
    ]
    records = {}
    for layout_name in ("rows", "channels"):
        samples = []
        for i, hidden in enumerate(states):
            codes, scales = quantize(hidden)
            if layout_name == "channels":
                codes = codes.t().contiguous().t()
            samples.append(
                SampleArrays(
                    f"s{i}",
                    np.arange(len(hidden), dtype=np.int32),
                    np.ones(len(hidden), np.uint8),
                    {1: QuantizedStates(codes, scales)},
                )
            )
        create_store(
            tmp_path / layout_name, _fp8_fingerprint(), CodecConfig(name="channels", channel_rows=256)
        ).write_shard("shard-000000", samples)
        shard = layout.shard_dir(tmp_path / layout_name, "shard-000000")
        records[layout_name] = json.loads((shard / layout.COMMIT_RECORD).read_text())
    assert records["channels"] == records["rows"]
    assert verify_store(tmp_path / "channels").ok


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_layer_statistics_equal_the_plain_float64_formulas(dtype):
    """The writer's fast statistics (bit-shift and table casts, sums by einsum) give
    the figures of ml_dtypes' own casts and numpy's two-pass variance, NaN/Inf and
    all-zero tokens included."""
    import math

    import ml_dtypes

    from store_schema.layer_stats import layer_stats

    rng = np.random.default_rng(1)
    values = (rng.standard_normal((300, 32)) * np.linspace(0.1, 40, 32)).astype(np.float32)
    values[3] = 0.0
    values[5, 2], values[6, 7] = np.nan, np.inf
    scales = None
    if dtype == "fp8":
        scales = rng.uniform(0.5, 2, 300).astype(np.float32)
        stored = (values / 512).astype(ml_dtypes.float8_e4m3fn)
        x = stored.astype(np.float64) * scales[:, None].astype(np.float64)
    else:
        stored = values.astype(ml_dtypes.bfloat16)
        x = stored.astype(np.float64)
    x[~np.isfinite(x)] = 0.0
    token_sq = np.square(x).mean(axis=1)
    got = layer_stats(stored, scales)
    assert layer_stats(np.ascontiguousarray(stored.T).T, scales) == got  # channel-major, as fp8 codes arrive
    if scales is None:  # bf16 arrives as the samples' row blocks
        assert layer_stats(RowBlocks(np.array_split(stored, 7)), scales) == got
    assert got.rms == pytest.approx(math.sqrt(token_sq.mean()), rel=1e-5)
    assert got.median_token_rms == pytest.approx(math.sqrt(np.median(token_sq)), rel=1e-5)
    assert got.token_spread == pytest.approx(math.sqrt(x.var(axis=0).mean()), rel=1e-5)
    assert got.zero_token_share == pytest.approx((~x.any(axis=1)).mean(), rel=1e-5)
    assert (got.min, got.max) == pytest.approx((x.min(), x.max()), rel=1e-5)


def test_real_states_read_back_bit_exact_through_every_path(tmp_path, qwen3_dir, tokenizer):
    """A store of the tiny Qwen3's states (default codec): the fast reader, windowed
    reads and plain zarr-python all give the bits the target produced."""
    from extract.extraction.runner import TargetRunner
    from extract.jobs.target import load_target

    path = stores.build_real_store(tmp_path / "s", qwen3_dir, tokenizer, num_samples=6, samples_per_shard=3)
    store = Store(path)
    assert store.codec.name == "bytesplit"
    records = builders.coding_chats(6)
    runner = TargetRunner(load_target(qwen3_dir), [1, 3])
    expected = {}
    for batch in (records[:3], records[3:]):  # as build_real_store batches them
        outputs = runner.run_batch([stores.chat_tokens(tokenizer, r, 160)[0] for r in batch])
        expected.update({r["id"]: out for r, out in zip(batch, outputs)})
    for name in store.committed_shards():
        data = store.read_shard(name)
        group = zarr.open_group(str(layout.shard_dir(path, name)), mode="r")
        for i in range(len(data)):
            sample = data.sample(i)
            start, stop = int(data.offsets[i]), int(data.offsets[i + 1])
            for layer in (1, 3):
                want = expected[sample.sample_id][layer].view(torch.int16)
                assert torch.equal(sample.hidden[layer].view(torch.int16), want)
                plain = group[layout.layer_array(layer)][start:stop].view(np.int16)
                assert np.array_equal(plain, want.numpy())
            window = store.read_window(name, i, 1, stop - start - 1, [3]).hidden[3]
            assert torch.equal(window.view(torch.int16), expected[sample.sample_id][3][1:-1].view(torch.int16))
    meta = json.loads((layout.shard_dir(path, "shard-000000") / "layer_1" / layout.ZARR_METADATA).read_text())
    assert meta["codecs"][0]["configuration"]["codecs"][1]["name"] == "blosc"  # a standard codec in zarr.json
    assert meta["attributes"]["dflash_codec"]["name"] == "bytesplit"


def _as_v1_root(path) -> None:
    """Rewrite a store's root the way the v1 writer wrote it: codec settings without a
    name (`cname`, `clevel`, `shuffle`, `chunk_bytes`), its root record over them."""
    meta_path = path / layout.ZARR_METADATA
    meta = json.loads(meta_path.read_text())
    codec = meta["attributes"][layout.ROOT_ATTR]["codec"]
    meta["attributes"][layout.ROOT_ATTR]["codec"] = {
        "cname": codec["cname"],
        "clevel": codec["level"],
        "shuffle": codec["shuffle"],
        "chunk_bytes": codec["chunk_bytes"],
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    record = json.loads((path / layout.ROOT_RECORD).read_text())
    root_files = (layout.ZARR_METADATA, f"{layout.SHARDS_DIR}/{layout.ZARR_METADATA}")
    write_record(
        path / layout.ROOT_RECORD,
        {
            "schema_version": record["schema_version"],
            "fingerprint_sha256": record["fingerprint_sha256"],
            "files": {rel: entry for rel, entry in describe_files(path).items() if rel in root_files},
        },
    )


@pytest.mark.parametrize("cname", ["zstd", "none"])
def test_a_store_written_with_the_v1_codec_reads_and_verifies(tmp_path, cname):
    codec = (
        CodecConfig(name="blosc", chunk_bytes=2048) if cname == "zstd" else CodecConfig(name="none", chunk_bytes=2048)
    )
    _, shards = builders.random_store(tmp_path / "s", codec=codec, topk=2)
    if cname == "zstd":
        _as_v1_root(tmp_path / "s")
    store = Store(tmp_path / "s")
    assert store.codec.name == ("blosc" if cname == "zstd" else "none")
    for data in store.iter_shards(store.committed_shards()):
        for i, expected in enumerate(shards[data.name]):
            for layer in (1, 3):
                assert torch.equal(
                    data.sample(i).hidden[layer].view(torch.int16), expected.hidden[layer].view(torch.int16)
                )
    assert verify_store(tmp_path / "s").ok


def test_codec_settings_are_checked_and_named():
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        CodecConfig(name="lz4")
    with pytest.raises(ValueError, match="settings of the blosc codec, not of 'bytesplit'"):
        CodecConfig(cname="lz4")
    with pytest.raises(ValueError, match="min_saving"):
        CodecConfig(min_saving=1.0)
    with pytest.raises(ValueError, match="unknown match_table 'tiny'; choose one of auto, full, small"):
        CodecConfig(match_table="tiny")
    assert (
        CodecConfig.from_json({k: v for k, v in CodecConfig().to_json().items() if k != "match_table"}) == CodecConfig()
    )
    assert (
        CodecConfig.from_json({"cname": "none", "clevel": 1, "shuffle": "shuffle", "chunk_bytes": 4096}).name == "none"
    )
    assert CodecConfig.from_json(CodecConfig(level=3).to_json()) == CodecConfig(level=3)
