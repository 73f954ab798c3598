"""The training path's own shard decoder (`store_schema.shard_decoder`) against plain
zarr-python: every array of a shard, every codec the writer makes, bit for bit."""

from __future__ import annotations

import struct

import builders
import numpy as np
import pytest
import torch
import zarr
from numcodecs import blosc

from store_schema import CodecConfig, CorruptShardError, Store, layout
from store_schema.codecs.blosc_chunk import decode_split_zstd_chunk
from store_schema.codecs.encoding import encode_bytesplit_chunk
from store_schema.reader import as_bits

CODECS = [
    CodecConfig(chunk_bytes=2048),  # the default (v2): bytesplit, high byte zstd-1, low byte raw
    CodecConfig(min_saving=0.0, chunk_bytes=2048),  # bytesplit coding every stream that shrinks at all
    CodecConfig(min_saving=0.99, level=3, chunk_bytes=1024),  # bytesplit storing every stream raw
    CodecConfig(name="blosc", chunk_bytes=2048),  # v1: blosc zstd-1, byte shuffle
    CodecConfig(name="none", chunk_bytes=2048),
    CodecConfig(name="blosc", cname="lz4", shuffle="bitshuffle", chunk_bytes=1024),
    CodecConfig(name="blosc", cname="zlib", level=5, shuffle="noshuffle", chunk_bytes=4096),
    # v3: chunks of 8 bf16 or 16 fp8 channels, a stream each; several row chunks per shard
    CodecConfig(name="channels", channel_rows=128),
]
CHANNELS = CODECS[-1]
CASES = [(codec, "bfloat16") for codec in CODECS] + [
    (CODECS[0], "fp8_e4m3"),
    (CODECS[3], "fp8_e4m3"),
    (CHANNELS, "fp8_e4m3"),
]


@pytest.mark.parametrize(
    "codec, dtype", CASES, ids=lambda c: c if isinstance(c, str) else f"{c.name}-{c.cname}-{c.shuffle}-{c.min_saving}"
)
def test_fast_decoder_matches_zarr_python_bit_for_bit(tmp_path, codec, dtype):
    """Shards whose token counts are not a multiple of the chunk rows (a padded last
    chunk), top-k arrays included; every array the shard holds is compared, so an
    array the writer adds later cannot go unpinned."""
    builders.random_store(tmp_path / "s", num_shards=3, samples_per_shard=3, codec=codec, topk=3, dtype=dtype)
    store = Store(tmp_path / "s")
    padded = 0
    for name in store.committed_shards():
        fast = store.read_shard(name)
        group = zarr.open_group(str(layout.shard_dir(store.path, name)), mode="r")
        plain = {array: group[array][...] for array in _arrays_in(store, name)}
        decoded = {
            layout.INPUT_IDS: fast.input_ids.numpy(),
            layout.LOSS_MASK: fast.loss_mask.numpy(),
            layout.SAMPLE_OFFSETS: fast.offsets,
            layout.SAMPLE_IDS: np.array(fast.sample_ids),
            layout.TOPK_IDS: fast.topk_ids.numpy(),
            layout.TOPK_LOGPROBS: fast.topk_logprobs.numpy(),
            **{layout.layer_array(i): as_bits(h, store.dtype) for i, h in fast.hidden.items()},
            **{layout.scale_array(i): s.numpy() for i, s in fast.scales.items()},
        }
        assert set(decoded) == set(plain)
        for array, values in plain.items():
            if layout.layer_id_of(array) is not None:
                values = values.view(store.dtype.bits)  # compared as raw bits: NaN payloads and -0 count
            elif values.dtype.kind in "OT":
                values = np.array([str(v) for v in values])
            assert decoded[array].dtype == values.dtype, array
            assert np.array_equal(decoded[array], values), f"{name}/{array}"
        tokens = store.commit(name).num_tokens
        padded += bool(tokens % codec.chunk_shape(tokens, 64, store.dtype.itemsize)[0])
    assert padded, "no shard with a partly filled last chunk: the padding path went untested"


def _arrays_in(store: Store, shard: str) -> list[str]:
    return sorted(p.parent.name for p in layout.shard_dir(store.path, shard).glob(f"*/{layout.ZARR_METADATA}"))


@pytest.mark.parametrize(
    "array, old, new",
    [
        ("layer_1", '"name": "blosc"', '"name": "gzip"'),
        ("layer_3", '"name": "sharding_indexed"', '"name": "other_sharding"'),
        ("input_ids", '"name": "zstd"', '"name": "gzip"'),
        ("loss_mask", '"data_type": "uint8"', '"data_type": "float16"'),
    ],
)
def test_fast_decoder_refuses_an_encoding_it_does_not_know_naming_the_array(tmp_path, array, old, new):
    builders.random_store(tmp_path / "s", num_shards=1)
    meta = tmp_path / "s/shards/shard-000000" / array / layout.ZARR_METADATA
    text = meta.read_text()
    assert old in text
    meta.write_text(text.replace(old, new))
    with pytest.raises(CorruptShardError, match=f"shard-000000: {array}: unsupported"):
        Store(tmp_path / "s").read_shard("shard-000000", verify=False)


def test_layer_arrays_are_told_apart_by_one_rule():
    for layer_id in (0, 1, 9, 63):
        assert layout.layer_id_of(layout.layer_array(layer_id)) == layer_id
    for name in (
        layout.INPUT_IDS,
        layout.SAMPLE_IDS,
        layout.TOPK_IDS,
        "layer_",
        "layer_01",
        "layer_x",
        "layer_-1",
        "layer_1/c/0/0",
        "layer_١",
    ):
        assert layout.layer_id_of(name) is None, name
    assert layout.array_of("layer_3/c/0/0") == "layer_3" and layout.array_of("zarr.json") == "zarr.json"


@pytest.mark.parametrize("min_saving", [0.0, 0.1, 0.99])  # both streams coded / high byte only / none
def test_split_zstd_decoder_takes_every_bf16_pattern_bit_for_bit(min_saving):
    """The fast path (not c-blosc) decodes the bytesplit chunks: all 65,536 bf16 bit
    patterns, whatever streams the encoder chose to code."""
    bits = np.arange(2**16, dtype=np.uint16)
    out = np.empty_like(bits)
    assert decode_split_zstd_chunk(memoryview(encode_bytesplit_chunk(bits, 1, min_saving)), out)
    assert np.array_equal(out, bits)


def test_split_zstd_decoder_takes_fp8_chunks_and_leaves_other_blosc_chunks_to_c_blosc():
    codes = np.tile(np.arange(256, dtype=np.uint8), 16)
    out = np.empty_like(codes)
    assert decode_split_zstd_chunk(memoryview(encode_bytesplit_chunk(codes, 1, 0.1)), out)
    assert np.array_equal(out, codes)
    bits = np.arange(4096, dtype=np.uint16)
    for cname, shuffle in [("zstd", blosc.SHUFFLE), ("lz4", blosc.SHUFFLE), ("zstd", blosc.BITSHUFFLE)]:
        chunk = blosc.compress(bits.tobytes(), cname.encode(), 1, shuffle)
        untouched = np.zeros_like(bits)
        assert not decode_split_zstd_chunk(memoryview(chunk), untouched)  # v1 and the rest: c-blosc
        assert not untouched.any()


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])  # bytesplit / channels chunks
def test_a_damaged_chunk_is_a_corrupt_shard_naming_the_chunk(tmp_path, dtype):
    """Unverified reads (verify=False) still refuse a chunk whose zstd stream is damaged."""
    builders.random_store(tmp_path / "s", num_shards=1, dtype=dtype)
    data = tmp_path / "s/shards/shard-000000/layer_1/c/0/0"
    raw = bytearray(data.read_bytes())
    _, _, _, typesize, nbytes, _, _ = struct.unpack_from("<BBBBiii", raw)
    stream = 16 + 4
    while struct.unpack_from("<i", raw, stream)[0] == nbytes // typesize:  # skip streams stored raw
        stream += 4 + struct.unpack_from("<i", raw, stream)[0]
    raw[stream + 4 : stream + 12] = b"\xff" * 8  # the first zstd frame's magic and header
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match="shard-000000: layer_1: inner chunk 0 does not decode"):
        Store(tmp_path / "s").read_shard("shard-000000", verify=False)


def test_mapped_files_read_verify_and_refuse_damage_like_read_ones(tmp_path, monkeypatch):
    """Large files are memory-mapped (`read_file`); with every file mapped, the fast
    reader gives the same states and verify still finds a flipped byte."""
    from store_schema import shard_decoder as shard_codec
    from store_schema.tools.verify import verify_store

    builders.random_store(tmp_path / "s", num_shards=2, codec=CodecConfig(chunk_bytes=2048))
    store = Store(tmp_path / "s")
    read = {name: store.read_shard(name) for name in store.committed_shards()}
    monkeypatch.setattr(shard_codec, "_MAP_AT_BYTES", 0)
    assert isinstance(shard_codec.read_file(tmp_path / "s/shards/shard-000000/layer_1/c/0/0"), memoryview)
    for name, expected in read.items():
        mapped = Store(tmp_path / "s").read_shard(name)
        assert all(
            torch.equal(mapped.hidden[i].view(torch.int16), expected.hidden[i].view(torch.int16))
            for i in expected.hidden
        )
    assert verify_store(tmp_path / "s").ok
    data = tmp_path / "s/shards/shard-000001/layer_1/c/0/0"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    report = verify_store(tmp_path / "s")
    assert not report.ok and any("shard-000001" in str(p) and "crc32c" in str(p) for p in report.problems)
    with pytest.raises(CorruptShardError, match="shard-000001: layer_1/c/0/0"):
        Store(tmp_path / "s").read_shard("shard-000001")
