"""A run's parts, built from its config after the checks of `train.fitting.preflight`
(`Trainer.from_config` = preflight + this).

The target's config is read once and the store opened once (by the preflight); the
loaded config is never edited: what the run fixes when it starts (the mask token
id, the lane count) goes into a resolved copy, which the run saves and trains
with. Resumed, each part is restored from the checkpoint by the `Checkpointer`
after it is built: the drafter, the optimizer, the global RNGs and the data feed
(every lane's position and generator)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from store_schema import StoreReader
from store_schema.runtime.cli import SKIP_SPACE_CHECK_FLAG
from store_schema.runtime.target_model import compute_dtype
from train.config import RunConfig
from train.config_error import ConfigError
from train.data.cache import lanes_per_node
from train.data.lanes import LaneFeed, check_world, lane_positions, resumed_deal
from train.data.lanes import total_steps as lane_steps
from train.data.loader import CorruptShards, LoaderSpec, ShardLoader, check_lanes
from train.dtypes import torch_dtype
from train.families.family import Drafter
from train.families.kinds import config_from_state, family_named, family_of
from train.fitting.checkpoint import Checkpointer, read_state
from train.fitting.distributed import device_for, init_process_group
from train.fitting.global_rng import GlobalRNG
from train.fitting.optimizer import Optimizer
from train.fitting.preflight import Checked, FitChecks, check_data, check_store, epochs_for
from train.fitting.start import read_source
from train.fitting.store_projection import ProjectionPart
from train.target_head import TargetHead, load_target_head
from train.world import World, local_world_size, world_from_env


@dataclass
class RunParts:
    """What `Trainer` is made of."""

    config: RunConfig  # resolved: the saved config.yaml
    drafter: Drafter  # of the family `model.architecture` names
    head: TargetHead
    optimizer: Optimizer
    feed: LaneFeed
    checkpointer: Checkpointer
    world: World
    device: torch.device
    start_step: int
    store: StoreReader  # opened once, by the preflight
    record: dict  # what every checkpoint records of the run: store, run_info
    log: Callable[[str], None]


def build_run(
    config: RunConfig, latest: Path | None, log: Callable[[str], None], world: World | None, checks: FitChecks
) -> RunParts:
    """The run's parts: `latest` is the checkpoint it continues (None: a new run), as
    `Checkpointer.resume_point` chose it once."""
    world = world or world_from_env()
    log = log if world.is_main else quiet  # rank 0 speaks for the job
    train = config.train
    checkpointer = Checkpointer(config.out, every=train.checkpoint_every, keep=train.keep_checkpoints)
    device = device_for(world, train.device)
    init_process_group(world, device)
    resumed = read_state(latest) if latest is not None else None  # state.json, read once for the run
    checked = checked_run(config, latest, resumed, checks, world, device, log)
    lanes, shards = (
        resumed_deal(resumed["loader"], config.data.lanes, checked.store, latest)
        if resumed
        else (config.data.lanes_for(world.size), None)
    )
    config = dataclasses.replace(  # fixed for the run: its config and checkpoints record them
        config,
        data=dataclasses.replace(config.data, lanes=lanes),
        model=family_of(checked.drafter_config).resolved_model(config.model, checked.drafter_config),
    )
    head = load_target_head(
        config.target,
        dtype=compute_dtype(device, on_cuda=torch_dtype(train.dtype)),
        device=device,
        config=checked.target,
    )
    drafter = new_drafter(config, checked, fine_tune=latest is None, device=device, log=log)
    if resumed is not None:
        log(
            f"fit: resumed from {latest} at step {resumed['step']} "
            f"({resumed['step'] * train.sequences_per_step:,} samples trained on), "
            f"{lane_positions(resumed['loader'])[0].describe()}{' (lane 0)' if lanes > 1 else ''}"
        )
    feed, total_steps = new_feed(config, checked, shards, world, device, log)
    optimizer = Optimizer(drafter, config.optim, total_steps)
    start_step = resumed["step"] if resumed else 0
    if checks.space and world.is_main:
        checkpointer.check_space(checkpoint_bytes(drafter), total_steps - start_step, SKIP_SPACE_CHECK_FLAG)
    run_info = dict(checked.run_info)
    if resumed is not None and latest is not None:
        Checkpointer.load(latest, checkpoint_parts(drafter, optimizer, feed, checked.store))
        run_info.update(resumed.get("run_info", {}))  # how the run first started (e.g. the rule that chose the mask)
    if world.is_main:
        config.save(config.out)
    store = checked.store
    record = {
        "store": {
            "store": str(store.path),
            "fingerprint_sha256": store.fingerprint.sha256(),
            "layer_ids": checked.drafter_config.context_layer_ids,
        },
        "run_info": run_info,
    }
    return RunParts(config, drafter, head, optimizer, feed, checkpointer, world, device, start_step, store, record, log)


def checked_run(
    config: RunConfig,
    latest: Path | None,
    resumed: dict | None,
    checks: FitChecks,
    world: World,
    device: torch.device,
    log: Callable[[str], None],
) -> Checked:
    """Every check before step 1 (`train.fitting.preflight`), the drafter planned
    between the store's checks and the data's, which need its block size."""
    found = check_store(config, checks, log)
    model = config.model
    checkpointed = (config_from_state(resumed), str(latest)) if resumed is not None else None
    source = read_source(model.init_from) if model.init_from and checkpointed is None else None
    family = family_named(model.architecture)
    if source is not None and family_of(source.config) is not family:
        raise ConfigError(
            f"--init-from {model.init_from}: a {source.config.architecture} drafter, and model.architecture "
            f"{model.architecture} is another family's ({family.name}): set model.architecture="
            f"{source.config.architecture} or start without --init-from"
        )
    plan = family.plan(model, config.target, found.target, list(found.store.layer_ids), checkpointed, source, log)
    damaged = check_data(config, found.store, plan, checks, world, device, log)
    return Checked(found.store, found.target, plan.config, {**plan.run_info, **found.run_info}, damaged, plan.source)


def checkpoint_parts(drafter, optimizer, feed, store) -> dict:
    """The parts a checkpoint of this run holds (`checkpoint.PARTS`): a projected
    store's directions beside the drafter, optimizer, RNG and loader positions."""
    parts = {"drafter": drafter, "optimizer": optimizer, "rng": GlobalRNG(), "feed": feed}
    projection = store.projection()
    if projection is not None:
        parts["projection"] = ProjectionPart(projection)
    return parts


def checkpoint_bytes(drafter: nn.Module) -> int:
    """About one checkpoint: fp32 weights and AdamW's two fp32 moments of each."""
    return sum(p.numel() for p in drafter.parameters()) * 4 * 3


def new_drafter(
    config: RunConfig, checked: Checked, fine_tune: bool, device: torch.device, log: Callable[[str], None]
) -> Drafter:
    """The drafter, seeded by `train.seed`; a new fine-tuning run starts from
    `model.init_from`'s weights, any other new run takes from the store what its family
    needs (EAGLE-3: its draft vocabulary). fp32 master weights on `device`."""
    torch.manual_seed(config.train.seed)
    family = family_of(checked.drafter_config)
    drafter = family.build(checked.drafter_config)
    if fine_tune and checked.source is not None:
        family.load_start(drafter, checked.source)
    elif fine_tune:
        family.start_fresh(drafter, checked.store, config.data.heldout_fraction, log)
    drafter = drafter.to(device)
    drafter.gradient_checkpointing = config.model.gradient_checkpointing
    return drafter


def new_feed(
    config: RunConfig,
    checked: Checked,
    shards: list[str] | None,
    world: World,
    device: torch.device,
    log: Callable[[str], None],
) -> tuple[LaneFeed, int]:
    """This rank's lanes of the run's sample streams, and the run's optimizer steps
    (`train.max_steps`, or the epochs' worth: `epochs_for` says which wins). A fine-tuned
    drafter reads its own layers of the store. `shards`: a resumed run's list."""
    lanes, batch, store = config.data.lanes_for(world.size), config.train.sequences_per_step, checked.store
    check_world(world.size, lanes, batch, resumed=shards is not None)
    corrupt = CorruptShards(checked.damaged, log)
    check_lanes(store.path, lanes, len(shards or store.committed_shards()))
    drafter = checked.drafter_config
    spec = LoaderSpec(
        drafter.context_layer_ids,
        family_of(drafter).sample_filter(drafter),
        planned_trainable=family_of(drafter).planned_filter(drafter),
        seed=config.train.seed,
        epochs=config.train.epochs,
        lanes=lanes,
        shards=shards,
        device=device,
        cache_share=lanes_per_node(lanes, world.size, local_world_size(world)),
    )

    def make_loader(lane: int, epochs: int = config.train.epochs) -> ShardLoader:
        return ShardLoader(
            store, config.data, dataclasses.replace(spec, lane=lane, epochs=epochs), log=log, corrupt=corrupt
        )

    order = make_loader(0)  # reads nothing: the sample order, to size the run
    epochs = epochs_for(
        config.train.max_steps, config.train.epochs, lambda e: lane_steps(order.lane_totals(e), batch), log
    )
    feed = LaneFeed.for_rank(world, lanes, batch, config.train.seed, device, lambda lane: make_loader(lane, epochs))
    return feed, config.train.max_steps or lane_steps(order.lane_totals(epochs), batch)


def quiet(message: str) -> None:
    """The log of ranks other than 0."""
