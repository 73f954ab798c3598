"""Writing shards, for every backend (a store is created by `directory.root` or
`objstore.commit`).

One writer owns a shard: it checks the samples against the plan, writes the shard's
arrays into a private directory (`ShardWriter`, written once here), and hands them to
its backend's commit (`commit_written`): a directory stages them under `.staging/`,
records size + crc32c of every file, fsyncs and renames the directory into `shards/`
(`directory.writer.StoreWriter`); a bucket uploads them from its spool and publishes a
create-only marker (`objstore.commit.BucketWriter`). Neither writer derives from the other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import zarr

from . import layout
from .codecs import zarr_dtypes  # noqa: F401  registers bfloat16 / float8_e4m3fn with zarr
from .codecs.arrays import RowBlocks
from .codecs.encoding import ARRAY_CODEC_ATTR, SPLIT_CODECS, write_bytesplit_shard
from .commit.lock import Attempt
from .commit.records import ShardCommit
from .dtypes import QuantizedStates, StoreDtype, store_dtype
from .layer_stats import layer_stats, refuse_empty_capture
from .layer_values import bf16_tensor, bf16_values, joined_layer, quantized_values
from .layout import WRITE_ALL_CHUNKS, write_small_array
from .plan import Plan, sample_digest
from .projection import Projection, project
from .root import StoreRoot


class Upload(NamedTuple):
    """One shard's trip to object storage: bytes sent, seconds of the upload alone, and
    seconds its writer waited for room in the local spool before building it."""

    sent: int = 0
    seconds: float = 0.0
    spool_wait_seconds: float = 0.0


@dataclass
class SampleArrays:
    """One sample as a writer receives it. Hidden states are bf16 [tokens, hidden]
    (torch or numpy); no padded positions. An fp8 or fp4 store quantizes them itself,
    or takes them already quantized (`dtypes.QuantizedStates`, e.g. done on the GPU)."""

    sample_id: str
    input_ids: np.ndarray  # int32 [tokens]
    loss_mask: np.ndarray  # uint8 [tokens]
    hidden: dict  # layer id -> bf16 [tokens, hidden] (or QuantizedStates for an fp8 / fp4 store)
    topk_ids: np.ndarray | None = None  # int32 [tokens, k]
    topk_logprobs: np.ndarray | None = None  # float32 [tokens, k]


class ShardWriter:
    """Writes one store's shards; what a backend answers (the plan, commits, reports) raises
    NotImplementedError here. Reopen a store's writer through its backend
    (`stores.backend(path).writer()`)."""

    direct_io = True  # layer files go past the page cache (`runtime.file_writes`): nothing here reads them soon

    def __init__(self, path, root: StoreRoot):
        self.path = path  # how messages name the store: a directory, or a bucket's URL
        self.attrs, self.fingerprint, self.codec = root.attrs, root.fingerprint, root.codec
        self._plan: Plan | None = None
        self._projection: Projection | None = None

    # -- what each backend answers ------------------------------------------------------
    def write_plan(self, plan: Plan) -> None:
        """Write the plan once; a second, different plan is refused."""
        raise NotImplementedError

    def plan(self) -> Plan | None:
        """The committed plan (None while there is none), read once."""
        raise NotImplementedError

    def is_committed(self, name: str) -> bool:
        raise NotImplementedError

    def commit_written(
        self, name: str, write, make_record, attempt: Attempt | None, check, need: int = 0
    ) -> dict | None:
        """Commit a shard: `write(where)` writes its arrays (returning the summary),
        `make_record(summary, files)` its commit record, `check(where, record)` it before
        publishing; `need` bytes are reserved where it is built. The record, or None when
        another writer committed the shard first."""
        raise NotImplementedError

    def upload_of(self, name: str) -> Upload:
        """Shard `name`'s upload (nothing for a directory)."""
        raise NotImplementedError

    def projection(self) -> Projection | None:
        """A projected store's directions (None: states stored whole), read once."""
        raise NotImplementedError

    def write_report(self, name: str, report: dict):
        """Keep a job's report of shard `name`; where it went."""
        raise NotImplementedError

    # -- shards -------------------------------------------------------------------------
    def write_shard(self, name: str, samples: list[SampleArrays], attempt: Attempt | None = None) -> ShardCommit | None:
        """Write and commit one shard; its commit record (what was written: files and
        sizes, so a caller need not read the store back), or None if it was already
        committed (e.g. by a worker presumed dead): the committed copy is kept.

        With the driver's `attempt`, the writer claims it before committing and raises
        `ShardFenced` if the driver revoked it (`store_schema.commit.lock`). The claim comes
        before the checksums: from then on nobody else touches the staging directory,
        so what the commit record lists is what the rename makes visible -- checked
        once more (every array there, every file at its size) right before the rename."""
        if self.is_committed(name):
            return None
        self._check_against_plan(name, samples)

        def record(summary: dict, files: dict) -> dict:
            body = {"shard": name, "fingerprint_sha256": self.fingerprint.sha256(), "files": files, **summary}
            return ShardCommit.from_json(body).to_json()

        def check(staging: Path, body: dict) -> None:
            commit = ShardCommit.from_json(body)
            _check_complete(staging, commit, self._arrays(commit.target_topk))

        topk = 0 if not samples or samples[0].topk_ids is None else int(np.shape(samples[0].topk_ids)[1])
        need = layout.shard_bytes_bound(
            sum(len(s.input_ids) for s in samples), self.fingerprint.hidden_size, len(self.fingerprint.layer_ids), topk
        )
        committed = self.commit_written(
            name, lambda staging: self._write_arrays(staging, name, samples), record, attempt, check, need
        )
        return None if committed is None else ShardCommit.from_json(committed)

    def _arrays(self, topk: int) -> set[str]:
        """The arrays every committed shard holds."""
        names = {layout.layer_array(L) for L in self.fingerprint.layer_ids}
        names |= {layout.INPUT_IDS, layout.LOSS_MASK, layout.SAMPLE_OFFSETS, layout.SAMPLE_IDS}
        return names | ({layout.TOPK_IDS, layout.TOPK_LOGPROBS} if topk else set())

    def _write_arrays(self, staging: Path, name: str, samples: list[SampleArrays]) -> dict:
        """Write the shard's arrays; a layer without signal is refused before it is
        written (`layer_stats.refuse_empty_capture`), and every layer's statistics go
        into the summary, hence the commit record."""
        if not samples:
            raise ValueError("a shard needs at least one sample")
        group = zarr.open_group(str(staging), mode="w")
        lengths = [len(s.input_ids) for s in samples]
        num_tokens = int(sum(lengths))
        kept = self._kept_states(samples)
        dtype = store_dtype(self.fingerprint.dtype)
        stats = {}
        for layer_id in self.fingerprint.layer_ids:
            values, scales = _layer_values(kept[layer_id], dtype)
            stats[str(layer_id)] = layer_stats(values, scales, dtype)
            refuse_empty_capture(name, layer_id, stats[str(layer_id)])
            if scales is not None:
                write_small_array(group, layout.scale_array(layer_id), scales)
            self._write_layer(group, staging, layout.layer_array(layer_id), values, dtype)
        write_small_array(group, layout.INPUT_IDS, np.concatenate([np.asarray(s.input_ids, np.int32) for s in samples]))
        write_small_array(group, layout.LOSS_MASK, np.concatenate([np.asarray(s.loss_mask, np.uint8) for s in samples]))
        write_small_array(group, layout.SAMPLE_OFFSETS, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        write_small_array(
            group, layout.SAMPLE_IDS, np.array([s.sample_id for s in samples], dtype=np.dtypes.StringDType())
        )
        topk = 0
        if samples[0].topk_ids is not None:
            topk = int(samples[0].topk_ids.shape[1])
            write_small_array(
                group, layout.TOPK_IDS, np.concatenate([np.asarray(s.topk_ids, np.int32) for s in samples])
            )
            write_small_array(
                group, layout.TOPK_LOGPROBS, np.concatenate([np.asarray(s.topk_logprobs, np.float32) for s in samples])
            )
        return {
            "num_samples": len(samples),
            "num_tokens": num_tokens,
            "target_topk": topk,
            "layer_stats": {layer: entry.to_json() for layer, entry in stats.items()},
        }

    def _kept_states(self, samples: list[SampleArrays]) -> dict[int, list]:
        """Layer id -> (what, states) of every sample as the store keeps them: each checked
        for shape; a projected layer's given whole is projected here (coordinates, the
        shape the store keeps, are taken as they are)."""
        hidden_size, kept = self.fingerprint.hidden_size, {}
        for sample in samples:
            missing = set(self.fingerprint.layer_ids) - set(sample.hidden)
            if missing:
                raise ValueError(f"sample {sample.sample_id!r}: no hidden states for layers {sorted(missing)}")
        for layer_id in self.fingerprint.layer_ids:
            width, parts = self.fingerprint.layer_width(layer_id), []
            for sample in samples:
                what, states = f"sample {sample.sample_id!r} layer {layer_id}", sample.hidden[layer_id]
                shape, n = tuple(states.shape), len(sample.input_ids)
                if width != hidden_size and shape == (n, hidden_size) and not isinstance(states, QuantizedStates):
                    states = project(bf16_tensor(states), self._directions(layer_id))
                elif shape != (n, width):
                    raise ValueError(f"{what}: hidden states {shape}, expected ({n}, {width})")
                parts.append((what, states))
            kept[layer_id] = parts
        return kept

    def _directions(self, layer_id: int) -> torch.Tensor:
        """A projected layer's directions [H, K]."""
        projection = self.projection()
        if projection is None:
            raise ValueError(f"{self.path}: layer {layer_id} is not projected")
        return torch.from_numpy(projection.directions[layer_id])

    def _write_layer(self, group, staging: Path, name: str, values: np.ndarray | RowBlocks, dtype: StoreDtype) -> None:
        """One hidden-state array [tokens, hidden]: zarr.json through zarr, the shard file
        through the bytesplit encoder (`bytesplit`, `channels`; zarr's own for the others)."""
        num_tokens, hidden_size = values.shape
        rows, cols = self.codec.chunk_shape(num_tokens, hidden_size, dtype.itemsize)
        array = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=(rows, cols),
            shards=(layout.padded_shard_shape(num_tokens, rows), hidden_size),
            compressors=self.codec.compressors((rows, cols), dtype.itemsize),
            fill_value=0,
            config=WRITE_ALL_CHUNKS,
            attributes={ARRAY_CODEC_ATTR: self.codec.to_json()},
        )
        if self.codec.name in SPLIT_CODECS:
            write_bytesplit_shard(
                staging / name / layout.chunk_file(2), values.view(dtype.bits), self.codec, direct=self.direct_io
            )
        else:
            array[...] = np.asarray(values)

    def _check_against_plan(self, name: str, samples: list[SampleArrays]) -> None:
        plan = self.plan()
        if plan is None:
            return
        planned = plan.shard(name).samples
        got = [s.sample_id for s in samples]
        want = [p.sample_id for p in planned]
        if got != want:
            raise ValueError(f"shard {name}: samples {got[:3]}... do not match the plan's {want[:3]}...")
        for sample, p in zip(samples, planned):
            ids = np.asarray(sample.input_ids, np.int32)
            mask = np.asarray(sample.loss_mask, np.uint8)
            if sample_digest(ids.tobytes(), mask.tobytes()) != p.digest:
                raise ValueError(
                    f"shard {name} sample {p.sample_id!r}: tokens or loss mask differ from the plan "
                    "(corpus or tokenizer changed since planning?)"
                )


def _layer_values(kept: list, dtype: StoreDtype) -> tuple[np.ndarray | RowBlocks, np.ndarray | None]:
    """One layer's (values, scales) as the encoder takes them: a scaled dtype's codes
    joined as they came (channel-major from a device) with their scales; bf16 as the
    samples' row blocks, never joined into one array."""
    if dtype.scaled:
        parts = [quantized_values(states, what, dtype) for what, states in kept]
        return joined_layer([codes for codes, _ in parts]), np.concatenate([sc for _, sc in parts])
    return RowBlocks([bf16_values(states, what) for what, states in kept]), None


def _check_complete(staging: Path, commit: ShardCommit, arrays: set[str]) -> None:
    """The commit record lists every array and every listed file is there at its size."""
    missing = arrays - {layout.array_of(rel) for rel in commit.files}
    if missing:
        raise RuntimeError(f"shard {commit.shard}: staging lacks arrays {sorted(missing)}; not committed")
    for rel, entry in commit.files.items():
        try:
            size = (staging / rel).stat().st_size
        except FileNotFoundError:
            size = None
        if size != entry.size:
            raise RuntimeError(
                f"shard {commit.shard}: {rel} is {size} bytes, its commit record says {entry.size}; not committed"
            )
