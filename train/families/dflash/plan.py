"""Which DFlash drafter a run trains: its configuration, how the run started, and
the drafter it starts from (`train.fitting.build` plans it through the family between
the store's checks and the data's)."""

from __future__ import annotations

from collections.abc import Callable

from store_schema.runtime.target_config import TargetConfig
from train.config_error import ConfigError
from train.families.dflash.config import LossConfig, ModelConfig
from train.families.dflash.init_from import fine_tune_config, source_config
from train.families.dflash.mask_token import resolve_mask_token
from train.families.dflash.model import DrafterConfig
from train.families.dflash.published import fresh_drafter_config
from train.families.dflash.targets import default_gamma
from train.families.family import DrafterPlan, StartSource, chosen_layers


def plan_drafter(
    model: ModelConfig,
    target_path: str,
    target: TargetConfig,
    store_layer_ids: list[int] | None,
    resumed: tuple[DrafterConfig, str] | None,
    source: StartSource | None,
    log: Callable[[str], None],
) -> DrafterPlan:
    """The drafter a run trains, and how the run started (`run_info`, kept in its
    checkpoints and exports). Sized for the target (published geometry, the
    store's layers) by default; with `model.init_from`, the shape of that drafter
    (`train.families.dflash.init_from`); resumed, it must equal the checkpoint's. The mask token
    is resolved here (`train.families.dflash.mask_token`) and logged; the drafter config holds
    the id (the run's saved config records it: `train.fitting.build`). `resumed`: the
    drafter config of the checkpoint a resumed run continues, and that checkpoint."""
    checkpointed, latest = resumed if resumed is not None else (None, None)
    start = source_config(source) if source else None
    mask = resolve_mask_token(
        model.mask_token_id,
        target_path,
        target.vocab_size,
        init_from_id=start.mask_token_id if start else None,
    )
    log(f"fit: {mask.describe()}")
    run_info: dict = {"mask_token_rule": mask.rule}
    if model.init_from:
        base, where = (start, f"--init-from {model.init_from}") if start else (checkpointed, f"--resume {latest}")
        assert base is not None  # a run with model.init_from loads that drafter or resumes its checkpoint
        drafter_config = fine_tune_config(base, where, model, target, store_layer_ids, mask.id)
    else:
        chosen = chosen_layers(model.target_layer_ids, store_layer_ids, target.num_hidden_layers)
        drafter_config = fresh_drafter_config(
            target,
            mask.id,
            store_layer_ids,
            model.geometry(),
            log=None if checkpointed else log,
            chosen_layer_ids=chosen,
        )
    if checkpointed is not None:
        changed = drafter_config.differences(checkpointed)
        if changed:
            raise ConfigError(f"--resume: {latest} holds a different drafter: {'; '.join(changed)}")
    if source is not None:
        run_info["init_from"] = source.record()
        log(
            f"fit: fine-tuning from {run_info['init_from']['path']} (weights sha256 "
            f"{run_info['init_from']['model_sha256'][:12]})"
        )
    return DrafterPlan(drafter_config, run_info, source)


def check_block_size(store, block_size: int) -> None:
    """One owner of the block size: the store's plan records the block its samples
    were planned for (each holds >= 2 blocks of loss tokens). A larger drafter
    block would find samples without a whole block and skip them silently; a
    smaller one fits every sample."""
    plan = store.plan()
    planned = (plan.settings or {}).get("block_size") if plan is not None else None
    if planned is not None and block_size > int(planned):
        raise ConfigError(
            f"config model.block_size: {block_size}, but {store.path} was planned for "
            f"block size {planned} (its plan's block_size); set model.block_size={planned} or "
            "re-plan the store with --block-size"
        )


def check_store(config: DrafterConfig, loss: LossConfig, store) -> None:
    """The drafter's block size against the store's plan, and a default slot weight for it."""
    check_block_size(store, config.block_size)
    if loss.gamma is None:
        default_gamma(config.block_size)  # refuse a block size without a default before any work
