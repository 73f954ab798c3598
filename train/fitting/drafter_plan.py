"""Which drafter a run trains: its configuration, how the run started, and the
drafter it starts from (`train.fitting.build` plans it between the store's checks and
the data's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from store_schema.layout import validate_layer_ids
from store_schema.runtime.target_config import TargetConfig
from train.config import RunConfig
from train.config_error import ConfigError
from train.families.dflash.mask_token import resolve_mask_token
from train.families.dflash.model import DrafterConfig
from train.families.dflash.published import fresh_drafter_config
from train.fitting.init_from import StartSource, fine_tune_config, read_source


def chosen_layers(wanted: list[int] | None, store_layer_ids: list[int], num_target_layers: int) -> list[int] | None:
    """`model.target_layer_ids`, checked: the layer-id rule, and every one in the store
    (ConfigError naming the missing ones and how to extract them); None when unset."""
    if wanted is None:
        return None
    try:
        ids = validate_layer_ids(list(wanted), num_target_layers)
    except ValueError as error:
        raise ConfigError(f"config model.target_layer_ids: {error}") from None
    missing = [layer for layer in ids if layer not in store_layer_ids]
    if missing:
        raise ConfigError(
            f"config model.target_layer_ids: {ids} needs layers {missing} the store does not hold (it "
            f"holds {store_layer_ids}); extract a store for several drafters with `python -m extract run "
            "... --layers-from DIR,DIR` (their union)"
        )
    return ids


@dataclass(frozen=True)
class DrafterPlan:
    """The drafter a run trains and how the run started (checkpoints keep `run_info`)."""

    config: DrafterConfig
    run_info: dict
    source: StartSource | None  # the `model.init_from` drafter a new run loads; None otherwise


def plan_drafter(
    config: RunConfig,
    target: TargetConfig,
    store_layer_ids: list[int],
    latest: Path | None,
    resumed: dict | None,
    log: Callable[[str], None],
) -> DrafterPlan:
    """The drafter a run trains, and how the run started (`run_info`, kept in its
    checkpoints and exports). Sized for the target (published geometry, the
    store's layers) by default; with `model.init_from`, the shape of that drafter
    (`train.fitting.init_from`); resumed, it must equal the checkpoint's. The mask token
    is resolved here (`train.families.dflash.mask_token`) and logged; the drafter config holds
    the id (the run's saved config records it: `train.fitting.build`). `resumed`: the
    state.json of `latest`, the checkpoint a resumed run continues, as the build read it."""
    model = config.model
    checkpointed = DrafterConfig.from_state(resumed) if resumed is not None else None
    source = read_source(model.init_from) if model.init_from and checkpointed is None else None
    mask = resolve_mask_token(
        model.mask_token_id,
        config.target,
        target.vocab_size,
        init_from_id=source.config.mask_token_id if source else None,
    )
    log(f"fit: {mask.describe()}")
    run_info: dict = {"mask_token_rule": mask.rule}
    if model.init_from:
        base, where = (
            (source.config, f"--init-from {model.init_from}") if source else (checkpointed, f"--resume {latest}")
        )
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
