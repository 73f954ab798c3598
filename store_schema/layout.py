"""Where everything lives in a store, and how arrays are encoded.

    STORE/
      zarr.json                 root group; attributes["dflash_store"] = schema version,
                                fingerprint (its dtype: bfloat16, fp8_e4m3, fp4_e2m1), codec and
                                chunking settings (`encoding.CodecConfig`)
      dflash_store.json         root record: crc32c + size of the root metadata files
      projection.safetensors    projected stores only: each projected layer's directions
                                float32 [hidden, K] (`store_schema.projection`)
      plan/                     the job plan (zarr arrays) + commit.json
      shards/zarr.json          group of committed shards
      shards/shard-000000/      one committed shard (a zarr group), written by one writer:
        layer_{L}/              bf16 [tokens, hidden] per context layer L, one zarr shard file
                                of inner chunks (chunk_tokens x hidden); fp8 stores: float8_e4m3fn;
                                fp4 stores: uint8 [tokens, hidden / 2], two e2m1 codes a byte;
                                a projected layer holds K coordinates a token, not hidden
        layer_{L}_scale/        fp8 stores: float32 [tokens], each token's scale; fp4 stores:
                                uint8 [tokens, hidden / 32], each block's exponent + 127
        input_ids/ loss_mask/   int32 / uint8 [tokens]
        sample_offsets/         int64 [samples + 1]
        sample_ids/             string [samples]
        target_topk_ids/        int32 [tokens, k] (optional)
        target_topk_logprobs/   float32 [tokens, k] (optional)
        commit.json             size + crc32c of every file above; written before the
                                directory is renamed into shards/, so it is the commit
      commits/NAME.json         the store's own list of what it committed: written by each
                                commit right after the rename (a committed shard whose
                                directory is gone is damage, not an unfinished job)
      .staging/                 shards being written aside (never visible to readers)
      damaged/                  shards `verify --repair` (or a job) moved out of shards/, kept
                                until the job that re-extracts them completes the store
      .lock                     held (flock) by the one live job writing the store
      reports/                  job reports (JSON)

A shard becomes visible by one atomic rename of a complete directory, so a crash
never leaves a half-written shard where readers look."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

SCHEMA_VERSION = 1
ROOT_ATTR = "dflash_store"
LAYER_ID_CONVENTION = "output of decoder layer L (0-based) = transformers hidden_states[L+1], before the final norm"

ZARR_METADATA = "zarr.json"  # a zarr v3 group's or array's metadata file
ROOT_RECORD = "dflash_store.json"
PLAN_DIR = "plan"
SHARDS_DIR = "shards"
COMMITS_DIR = "commits"  # the commit journal (store_schema.commit.journal)
STAGING_DIR = ".staging"
DAMAGED_DIR = "damaged"
LOCK_FILE = ".lock"
REPORTS_DIR = "reports"
PROJECTION_FILE = "projection.safetensors"  # a projected store's directions (`store_schema.projection`)
COMMIT_RECORD = "commit.json"

INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
SAMPLE_OFFSETS = "sample_offsets"
SAMPLE_IDS = "sample_ids"
TOPK_IDS = "target_topk_ids"
TOPK_LOGPROBS = "target_topk_logprobs"

# Arrays of the plan group, one row per planned sample.
PLAN_SAMPLE_IDS = "sample_ids"
PLAN_DIGESTS = "digests"
PLAN_RECORD_INDEX = "record_index"
PLAN_NUM_TOKENS = "num_tokens"
PLAN_NUM_LOSS_TOKENS = "num_loss_tokens"
PLAN_SHARD_INDEX = "shard_index"


def default_layer_ids(num_layers: int, num_context_layers: int) -> list[int]:
    """DFlash's default spread of context layers over an N-layer target:
    ``[N // 2]`` for one layer, else ``round(1 + i * (N - 4) / (n - 1))`` for
    ``i < n`` (layers 1 .. N-3; Qwen3-8B, N=36, n=5 -> [1, 9, 17, 25, 33]).

    Python's ``round`` (half to even) on purpose: it is what the reference
    implementation computes, so ids agree with released drafters. Validated with
    `validate_layer_ids`: a small target can give repeated ids, which is refused."""
    n, N = int(num_context_layers), int(num_layers)
    if n < 1:
        raise ValueError(f"need at least one context layer, got {n}")
    if N < 2:
        raise ValueError(f"a target needs at least 2 decoder layers to have a context layer, got {N}")
    spread = [N // 2] if n == 1 else [int(round(1 + i * (N - 4) / (n - 1))) for i in range(n)]
    try:
        return validate_layer_ids(spread, N)
    except ValueError as error:
        raise ValueError(f"cannot spread {n} context layers over a {N}-layer target: {error}") from None


def drafter_layer_ids(directory) -> list[int]:
    """The target layers a drafter directory (z-lab's format: config.json with
    `dflash_config.target_layer_ids`, published or exported) reads, in this module's
    convention: what `extract --layers-from` stores for it."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a drafter directory (no config.json)")
    try:
        ids = json.loads(path.read_text())["dflash_config"]["target_layer_ids"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: no dflash_config.target_layer_ids (not a DFlash drafter's config)") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: dflash_config.target_layer_ids {ids!r} is not a list of layer ids")
    return ids


def validate_layer_ids(layer_ids, num_target_layers: int) -> list[int]:
    """The one rule for context layer ids; refuse ids that would silently change
    what the drafter sees.

    Ids must be ints in ``0 .. N-2``: the final layer ``N-1`` is never a context
    layer (its output is what the target's own head reads, so a drafter fed it
    learns a shortcut that does not exist at inference). They must be unique and
    strictly increasing: their order is the order features are concatenated into
    the drafter's ``fc``, and store, trainer and export must agree on one order,
    so unsorted ids are refused rather than sorted."""
    ids = list(layer_ids)
    if not ids:
        raise ValueError("no context layer ids given")
    for layer_id in ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise ValueError(f"layer id {layer_id!r} is not an integer")
    num_layers = int(num_target_layers)
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise ValueError(
            f"layer ids {bad} are outside 0..{num_layers - 2} for a {num_layers}-layer target "
            f"(id L = output of decoder layer L, 0-based; the final layer {num_layers - 1} is never a context layer)"
        )
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate layer ids {dupes} in {ids}")
    if ids != sorted(ids):
        raise ValueError(f"layer ids {ids} are not in increasing order; pass {sorted(ids)}")
    return ids


def raw_bytes_per_token(hidden_size: int, num_layers: int) -> int:
    """Uncompressed bytes one token costs in a store: bf16 hidden states of every
    context layer, an int32 token id and a uint8 loss-mask value."""
    return 2 * int(hidden_size) * int(num_layers) + 4 + 1


_LAYER_PREFIX = "layer_"


def layer_array(layer_id: int) -> str:
    """The array holding context layer `layer_id`'s hidden states in a shard."""
    return f"{_LAYER_PREFIX}{layer_id}"


def scale_array(layer_id: int) -> str:
    """The array holding context layer `layer_id`'s scales in an fp8 or fp4 shard."""
    return f"{layer_array(layer_id)}_scale"


def layer_id_of(array_name: str) -> int | None:
    """The layer id a hidden-state array holds (`layer_5` -> 5); None for any other
    array, so callers tell hidden states from token arrays by this one rule."""
    digits = array_name[len(_LAYER_PREFIX) :] if array_name.startswith(_LAYER_PREFIX) else ""
    if digits.isascii() and digits.isdigit() and layer_array(int(digits)) == array_name:
        return int(digits)
    return None


def array_of(shard_file: str) -> str:
    """The array a file of a shard belongs to (its first path component): a commit
    record lists files, readers and `verify` name arrays."""
    return shard_file.split("/")[0]


def chunk_file(ndim: int) -> str:
    """Zarr v3's default key of chunk (0, ..., 0), relative to its array: every array of a
    shard is one chunk (one `sharding_indexed` file for hidden states)."""
    return "c/" + "/".join("0" * ndim)


def padded_shard_shape(num_tokens: int, chunk_tokens: int) -> int:
    """Zarr needs the shard shape to be a multiple of the inner chunk shape."""
    return max(1, math.ceil(num_tokens / chunk_tokens)) * chunk_tokens


def shard_dir(store: Path, name: str) -> Path:
    return Path(store) / SHARDS_DIR / name


def is_committed(store: Path, name: str) -> bool:
    """The one rule for "committed": the shard's directory is in `shards/` with its
    commit record. The record is written inside the staging directory before the
    rename into `shards/`, so a whole shard appears at once; a directory there
    without its record is not committed (never read; `verify` names it)."""
    return os.path.isfile(os.path.join(store, SHARDS_DIR, name, COMMIT_RECORD))  # strings: called per shard


# Zarr skips chunks equal to the fill value by default; a store writes every chunk so
# that each committed file exists and is covered by its checksum.
WRITE_ALL_CHUNKS = {"write_empty_chunks": True}


def write_small_array(group, name: str, data):
    """A one-chunk array (token ids, masks, offsets, ids, plan columns): zstd-3 for
    numbers, vlen-utf8 for strings. `shard_decoder.decode_array` decodes exactly this."""
    from zarr.codecs import ZstdCodec  # zarr only where an array is written: light commands read `layout`

    kwargs = dict(shape=data.shape, dtype=data.dtype, chunks=data.shape or (1,))
    if data.dtype.kind not in "OT":
        kwargs["compressors"] = [ZstdCodec(level=3)]
    array = group.create_array(
        name, fill_value=None if data.dtype.kind in "OT" else 0, config=WRITE_ALL_CHUNKS, **kwargs
    )
    array[...] = data
    return array


# A shard's files beyond its values: zarr metadata, chunk and shard indexes, blosc headers.
OVERHEAD_FRACTION, OVERHEAD_BYTES = 0.02, 1 << 20


def shard_bytes_bound(num_tokens: int, hidden_size: int, num_layers: int, topk: int = 0) -> int:
    """An upper bound on the bytes one shard takes on local disk: its states as raw bf16
    (every codec stores a stream it cannot shrink at its raw size; fp8 codes and
    scales take less), its per-token arrays, top-k, and the metadata around them."""
    values = num_tokens * num_layers * hidden_size * 2 + num_tokens * num_layers * 4
    per_token = num_tokens * (4 + 1 + topk * 8)
    raw = values + per_token
    return int(raw * (1 + OVERHEAD_FRACTION)) + OVERHEAD_BYTES
