"""The local shard cache (`data.cache_dir`, `data.cache_size`): what one lane keeps of
a store it cannot read fast enough where it lives (object storage, a shared
filesystem) on local disk, and when it fetches it.

The cache directory is a partial copy of the store (`store_schema.tools.local_copy` owns
the copy: whole committed shards, every file checked against its crc32c on arrival,
committed by rename); this module owns the policy:
- the lane's read order is known in advance (`train.data.order.SampleOrder`), so a
  thread fetches shards in that order, as far ahead as the budget allows;
- a pinned subset (the lane's shards by name, as many as fit beside room for
  `AHEAD` streamed shards) stays across epochs and across restarts; every other
  shard is streamed through: fetched before its turn, dropped once it has been read;
- at start, this lane's unpinned shards already in the directory are dropped; a pinned
  one is kept if, when its turn comes, it is still the store's and intact (checked
  against the store's commit record in the fetch thread, so a large cache does not
  delay step 1), and fetched again otherwise.

Each lane has its own `ShardCache` over the shared directory and touches only its own
lane's shards (lanes read disjoint shards); `budget` is the lane's share of
`data.cache_size`."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from store_schema import CorruptShardError, Store, StoreReader
from store_schema.runtime.units import human_bytes
from store_schema.tools.local_copy import (
    copied_shards,
    copy_shard,
    drop_copied_shard,
    keep_copied_shard,
    open_local_copy,
)
from train.data.order import LoaderPosition, SampleOrder

AHEAD = 2  # streamed shards fetched ahead of the one being read, where the budget allows


class CacheTooSmall(ValueError):
    """data.cache_size cannot hold the shards a lane must have at once."""


def pinned_shards(sizes: dict[str, int], budget: int | None) -> tuple[list[str], int]:
    """(pinned shards, room left for streamed ones): every shard if all fit, else the
    shards by name while room for `AHEAD` (at least one) of the largest is left."""
    total, largest = sum(sizes.values()), max(sizes.values())
    if budget is None or total <= budget:
        return sorted(sizes), 0 if budget is None else budget - total
    if budget < largest:
        raise CacheTooSmall(
            f"data.cache_size {human_bytes(budget)} per lane cannot hold the largest shard "
            f"({human_bytes(largest)}); give the cache at least that much per lane"
        )
    reserve = largest * AHEAD if budget >= largest * AHEAD else largest
    pinned, used = [], 0
    for name in sorted(sizes):
        if used + sizes[name] > budget - reserve:
            break
        pinned.append(name)
        used += sizes[name]
    return pinned, budget - used


class ShardCache:
    """One lane's cache of `source` in `directory`, `budget` bytes (None: no bound).
    `upcoming`: the shards in the order the lane reads them (repeats across epochs).
    `reader` is a `Store` over the directory whose `commit(name)` waits for the shard
    to arrive (so the loader reads through it as through any store); `release(name)`
    says one read of the shard is over."""

    def __init__(
        self,
        source: StoreReader,
        directory,
        budget: int | None,
        upcoming: list[str],
        log: Callable[[str], None] = print,
        lane: int = 0,
    ):
        self.source, self.directory, self.budget, self.log, self.lane = source, directory, budget, log, lane
        open_local_copy(directory, source)
        self.sizes = {name: source.commit(name).disk_bytes for name in set(upcoming)}
        pinned, _ = pinned_shards(self.sizes, budget)
        self.pinned = set(pinned)
        self.present: dict[str, int] = {}  # shard -> bytes, in the directory and ready
        self.failed: dict[str, CorruptShardError] = {}
        self.wanted: dict[str, int] = {}  # reads announced by the fetch thread, not yet released
        self.error: Exception | None = None  # what stopped the fetch thread (not a damaged shard)
        self.fetched_bytes = self.fetched_shards = 0
        self.reused: list[str] = []  # pinned shards found there and kept after checking
        self.unchecked = self._found(pinned)  # pinned shards found there, checked when their turn comes
        self._upcoming = upcoming
        self._cond = threading.Condition()
        self._stop = False
        self.reader = _ArrivalReader(self)
        self._thread = threading.Thread(target=self._fetch_ahead, daemon=True, name=f"shard-cache-lane{lane}")
        self._thread.start()
        log(
            f"cache: {directory} lane {lane}: {len(pinned)} of {len(self.sizes)} shard(s) pinned "
            f"({human_bytes(sum(self.sizes[n] for n in pinned))}), {len(self.unchecked)} of them there already "
            f"(checked as they are reached), budget {'unbounded' if budget is None else human_bytes(budget)}"
        )

    def _found(self, pinned: list[str]) -> set[str]:
        """The pinned shards already there; this lane's unpinned ones are dropped (they
        would take streaming room)."""
        there = set(copied_shards(self.directory)) & set(self.sizes)
        for name in sorted(there - self.pinned):
            drop_copied_shard(self.directory, name)
        return there & self.pinned

    @property
    def used(self) -> int:
        """Bytes the lane's shards take in the directory (unchecked pinned ones too)."""
        return sum(self.present.values()) + sum(self.sizes[name] for name in self.unchecked)

    def _reuse(self, name: str) -> bool:
        """Whether pinned shard `name`, found there at start, is kept (checked now)."""
        with self._cond:
            if name not in self.unchecked:
                return False
        kept = keep_copied_shard(self.source, self.directory, name)
        with self._cond:
            self.unchecked.discard(name)
            if kept:
                self.present[name] = self.sizes[name]
                self.reused.append(name)
            self._cond.notify_all()
        return kept

    def _fetch_ahead(self) -> None:
        try:
            self._fetch_all()
        except Exception as exc:
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _fetch_all(self) -> None:
        for name in self._upcoming:
            with self._cond:
                if self._stop:
                    return
                if name in self.failed:
                    continue
                self.wanted[name] = self.wanted.get(name, 0) + 1
                if name in self.present:
                    continue
            if self._reuse(name):
                continue
            with self._cond:
                while not self._stop and self.budget is not None and self.used + self.sizes[name] > self.budget:
                    self._cond.wait(0.5)
                if self._stop:
                    return
            try:
                copied = copy_shard(self.source, self.directory, name)
            except CorruptShardError as exc:
                with self._cond:
                    self.failed[name] = exc
                    self._cond.notify_all()
                continue
            with self._cond:
                self.present[name] = self.sizes[name]
                self.fetched_bytes += copied
                self.fetched_shards += 1
                self._cond.notify_all()

    def wait_for(self, name: str) -> None:
        """Block until shard `name` is in the directory; its fetch's error if it failed."""
        with self._cond:
            while name not in self.present and name not in self.failed and self.error is None and not self._stop:
                self._cond.wait(0.5)
            if name in self.failed:
                raise self.failed[name]
            if name not in self.present:
                raise self.error or RuntimeError(f"cache {self.directory}: closed before shard {name} arrived")

    def release(self, name: str) -> None:
        """One read of `name` is over: an unpinned shard no other announced read needs is dropped."""
        with self._cond:
            self.wanted[name] = max(0, self.wanted.get(name, 0) - 1)
            if name in self.pinned or self.wanted[name] or name not in self.present:
                return
            del self.present[name]
            drop_copied_shard(self.directory, name)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._stop:
                return
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.log(
            f"cache: {self.directory} lane {self.lane}: {len(self.reused)} shard(s) reused after checking, "
            f"{self.fetched_shards} fetched ({human_bytes(self.fetched_bytes)})"
        )


class _ArrivalReader(Store):
    """The cache directory as a store whose shards are read once they have arrived."""

    def __init__(self, cache: ShardCache):
        super().__init__(cache.directory)
        self.cache = cache

    def commit(self, name: str):
        self.cache.wait_for(name)
        return super().commit(name)


def lanes_per_node(lanes: int, world_size: int, local_world_size: int) -> int:
    """Lanes whose caches share one node's `data.cache_size` (every node runs as many processes)."""
    nodes = max(1, world_size // max(1, local_world_size))
    return math.ceil(lanes / nodes)


def upcoming_shards(order: SampleOrder, start: LoaderPosition, epochs: int, skip=()) -> list[str]:
    """The shards a lane reads from `start` to the end of its last epoch, in order."""
    names = []
    for epoch in range(start.epoch, epochs):
        groups = order.groups(epoch)[start.group if epoch == start.epoch else 0 :]
        names += [name for group in groups for name in group if name not in skip]
    return names
