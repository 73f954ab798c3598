"""What `fit` checks before step 1, so that a run never trains on something other
than what was asked without a word: the target is the store's (`train.target_check`),
the store is whole (committed shards against its plan and its commit journal) and
undamaged (the start check: the store's root and plan, a few shards re-read in full,
nothing read per shard, so it takes the same time at any shard count; the loader
checks each shard's commit record and every file's crc32c as it opens the shard,
before its samples reach a step, and `--verify-first` re-reads everything first),
the held-out split
holds samples, the lanes have shards to read, and `--max-steps` has the epochs it
needs (it wins over `train.epochs`: the loader runs as many epochs as the steps take,
and the schedule is built for those steps)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from store_schema import StoreReader
from store_schema.location import is_object_store
from store_schema.runtime.target_config import TargetConfig, read_target_config
from store_schema.stores import open_store
from store_schema.tools.verify import vanished, verify_store
from train.compatibility import check_store_against_target, check_topk
from train.config import RunConfig
from train.data.heldout import is_heldout
from train.families.family import DrafterPlan, FamilyConfig, StartSource
from train.families.kinds import family_of
from train.fitting.distributed import any_rank
from train.target_check import check_target
from train.world import World

REPAIR_COMMAND = "python -m store_schema verify {store} --repair"
SKIP_VERIFY_FLAG = "--skip-verify"


@dataclass(frozen=True)
class FitChecks:
    """The checks a caller may relax (each a `fit` flag)."""

    allow_other_target: bool = False  # --allow-other-target: train against another checkpoint (recorded)
    require_complete: bool = False  # --require-complete: refuse a store missing planned shards
    verify: bool = True  # the integrity pass before step 1 (--skip-verify turns it off)
    verify_first: bool = False  # --verify-first: re-read every committed file's crc32c before step 1
    space: bool = True  # the checkpoints fit in --out's free space (--skip-space-check turns it off)
    full_weights: bool = False  # --full-weights-check: every byte of the target's weights, not a sample


class DamagedStoreError(ValueError):
    """The integrity pass found damaged shards (exit 1)."""


@dataclass
class Checked:
    """What the checks found and the plan chose, for the build: the store opened once,
    the target's config read once, the drafter the run trains and how it started."""

    store: StoreReader
    target: TargetConfig
    drafter_config: FamilyConfig
    run_info: dict  # how the run started (mask token rule, --init-from, another target): checkpoints keep it
    damaged: list[str]  # shards the integrity pass left out (data.skip_corrupt_shards)
    source: StartSource | None  # the `model.init_from` drafter a new run loads


@dataclass
class StoreCheck:
    """The store and the target as the first checks found them."""

    store: StoreReader
    target: TargetConfig
    run_info: dict  # another target's record, when --allow-other-target let it through


def check_store(config: RunConfig, checks: FitChecks, log: Callable[[str], None]) -> StoreCheck:
    """The checks before the drafter is planned, in the order a person would want them
    refused: the store against the target, then the stored top-k."""
    target = read_target_config(config.target)
    store = open_store(config.store)
    check_store_against_target(store, target)
    other_target = check_target(
        store, config.target, allow_other_target=checks.allow_other_target, full=checks.full_weights, log=log
    )
    check_topk(store, topk_readers(config))
    return StoreCheck(store, target, other_target)


def topk_readers(config: RunConfig) -> list[str]:
    """The settings of a run that read the target's top-k from the store."""
    settings = {
        "loss.labels=target": config.loss.labels == "target",
        "loss.kl_mix > 0": config.loss.kl_mix > 0,
        "eval.labels=target": config.eval.labels == "target",
    }
    return [name for name, reads in settings.items() if reads]


def check_data(
    config: RunConfig,
    store: StoreReader,
    plan: DrafterPlan,
    checks: FitChecks,
    world: World,
    device: torch.device,
    log: Callable[[str], None],
) -> list[str]:
    """The checks after the drafter is planned: the planned drafter against the store and
    the loss section (its family's: DFlash's block size against the store's plan), then
    the store's completeness, integrity and split. Returns the shards the integrity pass
    left out."""
    family_of(plan.config).check_store(plan.config, config.loss, store, log)
    check_complete(store, checks, log)
    damaged = integrity_pass(store, config, log, world, device, checks.verify_first) if checks.verify else []
    check_heldout(store, config, log)
    return damaged


def check_complete(store: StoreReader, checks: FitChecks, log: Callable[[str], None]) -> None:
    """Warn (refuse with --require-complete) when the store holds fewer shards than planned."""
    plan = store.plan()
    if plan is None:
        return
    planned = {shard.name for shard in plan.shards}
    committed = set(store.committed_shards()) & planned
    if len(committed) == len(planned):
        return
    samples = sum(len(s.samples) for s in plan.shards if s.name in committed)
    line = (
        f"{store.path} is incomplete: {len(committed)} of {len(planned)} planned shards committed "
        f"({samples:,} of {plan.num_samples:,} samples)"
    )
    if checks.require_complete:
        raise ValueError(f"{line}; finish it with `python -m extract run` (--require-complete)")
    log(f"warning: {line}; training on those (--require-complete refuses)")


def integrity_pass(
    store: StoreReader,
    config: RunConfig,
    log: Callable[[str], None],
    world: World = World(),
    device: torch.device | None = None,
    verify_first: bool = False,
) -> list[str]:
    """The start check: the store's root and plan, the sampled shards re-read (every
    committed shard under `verify_first`), the job's processes sharing them out, and
    the commit journal against the committed shards (a journaled shard that is gone
    is damage). Returns the damaged shards (every rank gets the same list). Refused
    naming them and the repair command, unless `data.skip_corrupt_shards` (then
    they are left out, reported once here)."""
    committed = sorted(store.committed_shards())
    gone = vanished(store.journaled_shards() or set(), committed)  # two listings: the same on every rank
    reread = committed if verify_first else reread_sample(store, committed, config, log)
    mine = reread[world.rank :: world.size]
    local = verify_store(store, checksums_only=True, workers=config.data.loader_threads, shards=mine).problems
    local += gone
    named = committed + [p["shard"] for p in gone]
    hit = {p["shard"] for p in local}
    flags = any_rank(world, ["" in hit, *(name in hit for name in named)], device or torch.device("cpu"))
    root_damage, damaged = flags[0], [name for name, bad in zip(named, flags[1:]) if bad]
    if not root_damage and not damaged:
        return []
    names = ", ".join(damaged[:8]) + (f" and {len(damaged) - 8} more" if len(damaged) > 8 else "")
    repair = REPAIR_COMMAND.format(store=store.path)
    if config.data.skip_corrupt_shards and not root_damage:
        log(f"fit: {len(damaged)} damaged shard(s) left out (data.skip_corrupt_shards): {names}; repair: {repair}")
        return damaged
    first = local[0] if local else None
    where = (
        ""
        if first is None
        else (f"shard {first['shard']}: {first['file']}: " if first["shard"] else "") + f"{first['what']}; "
    )
    found = f"{len(damaged)} damaged shard(s) of {len(named)}: {names}" if damaged else "a damaged store root"
    raise DamagedStoreError(
        f"{where}the integrity pass found {found}; repair with `{repair}` and rerun `python -m extract run`, "
        f"or set data.skip_corrupt_shards=true to leave them out ({SKIP_VERIFY_FLAG} skips this check)"
    )


def reread_sample(store: StoreReader, committed: list[str], config: RunConfig, log: Callable[[str], None]) -> list[str]:
    """The shards re-read in full before step 1 (`data.verify_sampled_shards`, drawn
    with the run's seed; none on object storage, where that is a download): the
    others' commit records and bytes are checked as the loader opens them."""
    remote = is_object_store(store.path)
    count = 0 if remote else min(config.data.verify_sampled_shards, len(committed))
    sample = sorted(random.Random(config.train.seed).sample(committed, count))
    where = "as it arrives" if remote else "as the loader reads it"
    log(
        f"fit: start check: {len(committed)} committed shard(s) against the commit journal, {len(sample)} "
        f"re-read in full; each shard's commit record and every file's crc32c are checked {where}, "
        "before its samples reach a step (--verify-first re-reads every file before step 1)"
    )
    return sample


def heldout_count(store: StoreReader, fraction: float) -> int | None:
    """Samples of the store's plan in the held-out split (None without a plan)."""
    plan = store.plan()
    if plan is None:
        return None
    committed = set(store.committed_shards())
    return sum(
        is_heldout(s.sample_id, fraction) for shard in plan.shards if shard.name in committed for s in shard.samples
    )


def check_heldout(store: StoreReader, config: RunConfig, log: Callable[[str], None]) -> None:
    """An empty held-out split turns evaluation off: say so at the start, with the figures."""
    fraction = config.data.heldout_fraction
    if not config.eval.every or fraction <= 0:
        return
    count = heldout_count(store, fraction)
    if count == 0:
        committed = set(store.committed_shards())
        total = sum(len(s.samples) for s in store.plan().shards if s.name in committed)
        log(
            f"warning: data.heldout_fraction={fraction} holds out 0 of {total:,} samples: held-out evaluation is "
            f"off for this run and `train eval` will find no held-out sample; raise data.heldout_fraction "
            f"(e.g. {min(0.5, max(0.05, 4 / max(total, 1))):.2g})"
        )


def epochs_for(max_steps: int | None, epochs: int, steps_of: Callable[[int], int], log: Callable[[str], None]) -> int:
    """The loader's epochs: `train.epochs`, or, under `train.max_steps`, the fewest
    epochs whose samples last that many steps (`steps_of(e)`: the steps e epochs
    give). --max-steps wins, said in one line when it changes the epochs."""
    if max_steps is None or steps_of(epochs) >= max_steps:
        return epochs
    one = steps_of(1)
    needed = max(1, math.ceil(max_steps / max(one, 1)))
    while steps_of(needed) < max_steps and needed < max_steps:  # an epoch with a sample gives a step
        needed += 1
    if needed != epochs:
        log(
            f"fit: --max-steps {max_steps} (train.max_steps) overrides train.epochs={epochs}: "
            f"{needed} epoch(s) of {one} step(s) each"
        )
    return needed
