"""Which samples a run holds out, and where they lie in a store.

The split: a sample is held out when a stable hash of its id (sha256, not
Python's salted `hash`) falls below the run's `data.heldout_fraction`
(`is_heldout`, HELDOUT_RULE). It is the one owner of that rule: the loader never
trains on those samples, the trainer's evaluators and `python -m train eval`
read only them, and checkpoints and exports record the fraction with the rule
(`heldout_record`) so that eval later picks exactly the samples the run never
trained on.

The index: finding the first 32 held-out samples by reading shards from the
first one on read 322 shards (~0.25-0.5 TB decoded) per evaluator per
evaluation on the 902K-sample plan. `locate_samples` lists the (shard, row) of
the samples a predicate keeps from the store's plan, which already holds every
shard's sample ids in row order, so building it reads no shard at all (a store
without a plan falls back to each shard's small id arrays). `read_located` then
reads only that sample's rows through the store's partial reads (the inner
chunks its rows span), and checks that the row holds the sample the index says.
The loader builds the held-out index once per run and keeps it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from store_schema import StoreReader
from store_schema.stores import open_store
from train.data.config import SPLITS

HELDOUT_RULE = "sha256(sample_id)[:8] / 2**64 < fraction"


def is_heldout(sample_id: str, fraction: float) -> bool:
    """Stable across processes and machines: sha256 of the id as a number in [0, 1)
    (HELDOUT_RULE), compared with `fraction`."""
    if fraction <= 0:
        return False
    value = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") / 2.0**64
    return value < fraction


def heldout_record(fraction: float) -> dict:
    """How a run split its samples, as recorded in checkpoints and exports."""
    return {"fraction": fraction, "rule": HELDOUT_RULE}


def heldout_fraction_of(record: dict, where: str) -> float:
    """The fraction of a `heldout_record`; refused (naming `where`) if it was split
    by another rule or the fraction is not in [0, 1]."""
    fraction = record.get("fraction") if isinstance(record, dict) else None
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{where}: held-out split {record!r} has no fraction in [0, 1]")
    if record.get("rule") != HELDOUT_RULE:
        raise ValueError(f"{where}: held-out split rule {record.get('rule')!r} is not this trainer's {HELDOUT_RULE!r}")
    return float(fraction)


@dataclass(frozen=True)
class SampleLocation:
    """Where one sample is: its shard and row (index in the shard)."""

    shard: str
    index: int
    sample_id: str


def locate_samples(store, shards: Iterable[str], keep: Callable[[str], bool]) -> list[SampleLocation]:
    """The samples of `shards` whose id `keep` accepts, shards in sorted order and
    rows in shard order. From the store's plan when it covers every shard (no
    shard is read), else from each shard's id array (its small arrays only)."""
    names = sorted(shards)
    plan = store.plan()
    planned = {shard.name: shard for shard in plan.shards} if plan is not None else {}
    if all(name in planned for name in names):
        return [
            SampleLocation(name, row, sample.sample_id)
            for name in names
            for row, sample in enumerate(planned[name].samples)
            if keep(sample.sample_id)
        ]
    found = []
    for data in store.iter_shards(names, layers=[]):
        found += [
            SampleLocation(data.name, row, sample_id)
            for row, sample_id in enumerate(data.sample_ids)
            if keep(sample_id)
        ]
    return found


def heldout_locations(store, shards: Iterable[str], fraction: float) -> list[SampleLocation]:
    """The held-out samples of `shards` at `fraction` (the held-out index)."""
    return locate_samples(store, shards, lambda sample_id: is_heldout(sample_id, fraction))


def read_located(store, location: SampleLocation, layers, max_tokens: int | None = None):
    """The first `max_tokens` rows (None: all) of the sample at `location` with only
    `layers`, reading only the chunks those rows span (a store_schema `Sample`).
    Refused, naming the shard and row, when the row holds another sample than the
    index says (a plan that does not describe the shard)."""
    length = store.sample_length(location.shard, location.index)
    stop = length if max_tokens is None else min(length, max_tokens)
    sample = store.read_window(location.shard, location.index, 0, stop, layers)
    if sample.sample_id != location.sample_id:
        raise ValueError(
            f"{store.path}: shard {location.shard} row {location.index} holds sample {sample.sample_id!r}, "
            f"the store's plan says {location.sample_id!r}"
        )
    return sample


# -- the samples of a split ----------------------------------------------------------
def in_split(sample_id: str, split: str, heldout_fraction: float | None) -> bool:
    """Whether a sample belongs to `split` of a run that held out `heldout_fraction`."""
    if split == "all":
        return True
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if heldout_fraction is None or not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"split {split!r} needs the run's held-out fraction in [0, 1], got {heldout_fraction!r}")
    return is_heldout(sample_id, heldout_fraction) == (split == "heldout")


def split_locations(store, split: str, heldout_fraction: float | None) -> list:
    """Where the samples of `split` are (`train.data.heldout.SampleLocation`s, store
    order), from the store's plan: no shard is read."""
    in_split("", split, heldout_fraction)  # refuse a bad split before reading anything
    return locate_samples(store, store.committed_shards(), lambda i: in_split(i, split, heldout_fraction))


def read_samples(store, locations, layers: Sequence[int], need_topk: bool = False) -> Iterator:
    """The samples at `locations` with only `layers`, each reading only its own rows."""
    layers = store.require_layers(list(layers))
    for location in locations:
        sample = read_located(store, location, layers)
        if need_topk and sample.topk_ids is None:
            raise ValueError(
                f"{store.path}: labels='target' needs the target's top-k predictions, "
                "but this store has none (extract with topk=K)"
            )
        yield sample


def store_samples(
    store,
    layers: Sequence[int],
    split: str,
    heldout_fraction: float | None,
    max_samples: int | None = None,
    need_topk: bool = False,
) -> Iterator:
    """Samples of `split` in store order (shards sorted, samples in shard order)
    with only `layers`, at most `max_samples`: a few held-out samples cost their
    own rows, not a scan of the store."""
    store = store if isinstance(store, StoreReader) else open_store(store)  # a directory or an s3:// URL
    locations = split_locations(store, split, heldout_fraction)
    return read_samples(store, locations[:max_samples], layers, need_topk)
