"""The run config's `data` section: what the data feed reads and how (`train.data.loader`,
`train.data.lanes`, `train.data.cache`); `train/config.py` composes it into the run's."""

from __future__ import annotations

from dataclasses import dataclass

from store_schema.runtime.units import parse_bytes
from train.config_error import ConfigError, require

THINKING = ("on", "off", "both")  # `--thinking`: how chat prompts are rendered (train.data.prompts)
SPLITS = ("heldout", "train", "all")  # a run's samples: never trained on (data.heldout_fraction), the rest, both


@dataclass
class DataConfig:
    max_length: int = 3072  # sequences are cropped to this many tokens (from the start)
    heldout_fraction: float = 0.01  # share of samples (by a stable hash of the id) never trained on
    buffer_shards: int = 4  # samples are shuffled across groups of this many shards
    loader_threads: int | None = None  # threads decoding a shard's chunks in parallel; None: the cores available
    prefetch_samples: int = 8  # ready samples queued ahead of the trainer
    skip_corrupt_shards: bool = False  # False: a corrupt shard stops the run; True: skip it, logged
    verify_sampled_shards: int = 4  # committed shards re-read in full before step 1 (the rest: as the loader reads)
    lanes: int | None = (
        None  # sample streams the shard order is dealt into (train/data/loader.py); None: the world size
    )
    cache_dir: str | None = (
        None  # local directory caching whole shards of the store (train/data/cache.py); None: no cache
    )
    cache_size: int | str | None = (
        None  # the cache's bound per node, e.g. 2TB or 500GiB; None: no bound (every shard kept)
    )

    def lanes_for(self, world_size: int) -> int:
        """The run's sample streams: `lanes`, else one per process."""
        return self.lanes or world_size

    def validate(self):
        require(self.max_length >= 2, "data.max_length", "must be >= 2")
        require(0.0 <= self.heldout_fraction < 1.0, "data.heldout_fraction", "must be in [0, 1)")
        require(self.buffer_shards >= 1, "data.buffer_shards", "must be >= 1")
        require(
            self.loader_threads is None or self.loader_threads >= 1, "data.loader_threads", "must be >= 1 (or null)"
        )
        require(self.verify_sampled_shards >= 0, "data.verify_sampled_shards", "must be >= 0")
        require(self.prefetch_samples >= 1, "data.prefetch_samples", "must be >= 1")
        require(self.lanes is None or self.lanes >= 1, "data.lanes", "must be >= 1 (or null: the world size)")
        if self.cache_size is not None:
            try:
                parse_bytes(self.cache_size)
            except ValueError as error:
                raise ConfigError(f"config data.cache_size: {error}") from None
            require(self.cache_dir is not None, "data.cache_size", "needs data.cache_dir (where the cache lives)")
