"""`python -m store_schema project SRC --out DST`: a bf16 store's states again as a
projected store (`store_schema.projection`), optionally in a lossy dtype, shard by
shard under the same names, plan and samples: what a drafter trained on a smaller
store of the same samples would see, measured against the one trained on SRC.

The directions are fitted on SRC's first shards (`fit_tokens` states a layer) before
anything is written, and kept in DST; SRC is only read."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from ..directory.root import create_store_dir
from ..dtypes import store_dtype
from ..projection import Projection, fit, second_moment
from ..reader import StoreReader
from ..stores import open_store
from ..writer import SampleArrays


def fitted_projection(store: StoreReader, fit_tokens: int, energy: float | None, rank: int | None) -> Projection:
    """Each layer's directions, fitted on the states of `store`'s first shards."""
    moments: dict[int, np.ndarray] = {}
    tokens = 0
    for name in store.committed_shards():
        data = store.read_shard(name)
        take = min(int(data.offsets[-1]), fit_tokens - tokens)
        for layer in store.layer_ids:
            moment = second_moment(data.states(layer, 0, take))
            moments[layer] = moments[layer] + moment if layer in moments else moment
        tokens += take
        if tokens >= fit_tokens:
            break
    if not tokens:
        raise ValueError(f"{store.path}: no committed shard to fit a projection on")
    return fit(moments, tokens, energy=energy, rank=rank)


def shard_samples(data) -> list[SampleArrays]:
    """A shard's samples with their states whole (bf16), as a writer takes them."""
    samples = []
    for index, sample_id in enumerate(data.sample_ids):
        start, stop = int(data.offsets[index]), int(data.offsets[index + 1])
        topk = data.topk_ids is not None
        samples.append(
            SampleArrays(
                sample_id,
                data.input_ids[start:stop].numpy(),
                data.loss_mask[start:stop].numpy(),
                {layer: data.states(layer, start, stop) for layer in data.hidden},
                data.topk_ids[start:stop].numpy() if topk else None,
                data.topk_logprobs[start:stop].numpy() if topk else None,
            )
        )
    return samples


def project_store(source, out, *, energy=None, rank=None, dtype="bfloat16", fit_tokens=65_536, log=print) -> dict:
    """Write `out` from the bf16 store `source`, projected (and stored as `dtype`)."""
    src = open_store(source)
    if src.dtype.scaled or src.fingerprint.projection:
        raise ValueError(f"{source}: a projection is fitted on exact states; this store is not a whole bf16 one")
    started = time.time()
    projection = fitted_projection(src, fit_tokens, energy, rank)
    if not projection.directions:
        raise ValueError(
            f"{source}: every layer needs all {src.hidden_size} directions at that setting: nothing to project"
        )
    ranks = {layer: projection.rank(layer) for layer in projection.directions}
    kept = ", ".join(
        f"layer {layer}: {ranks[layer]} of {src.hidden_size} ({e:.4f})" for layer, e in projection.energy_kept.items()
    )
    log(f"projection fitted on {projection.fitted_tokens:,} tokens a layer: {kept}")
    fingerprint = dataclasses.replace(src.fingerprint, dtype=store_dtype(dtype).name, projection=projection.summary())
    writer = create_store_dir(Path(out), fingerprint, projection=projection)
    plan = src.plan()
    if plan is not None:
        writer.write_plan(plan)
    names = src.committed_shards()
    for done, data in enumerate(src.iter_shards(names), start=1):
        writer.write_shard(data.name, shard_samples(data))
        log(f"project: {done}/{len(names)} shards")
    return {
        "shards": len(names),
        "ranks": ranks,
        "energy_kept": projection.energy_kept,
        "seconds": round(time.time() - started, 1),
    }
