"""Fine-tuning a drafter people already serve: `fit --init-from DIR`.

DIR is any z-lab-format drafter directory (`config.json` with `dflash_config`
+ `model.safetensors`): a downloaded `z-lab/Qwen3.6-27B-DFlash`, a SpecForge
output, or this trainer's export; or one of this trainer's checkpoints
(`state.json` + `model.safetensors`), or a run directory (its newest checkpoint). The
run takes the drafter's whole shape from it and starts from its weights, after checking that it fits the run, each
refusal naming the field:

- `block_size` against the run's `model.block_size`;
- `hidden_size`, `num_target_layers`, `vocab_size` against the target (and so
  the store, which is checked against the target);
- `dflash_config.target_layer_ids` against the store's layers: the drafter's
  `fc` reads exactly those, in that order, so the store must hold every one
  (a store with more layers is fine: only the drafter's are read);
- the geometry keys the run sets (`model.num_hidden_layers`, heads, KV heads,
  `head_dim`, `intermediate_size`, `layer_types`, `sliding_window`): a value
  given must equal the drafter's; unset ones take the drafter's;
- `model.architecture` against the drafter's, with one exception: a DFlash
  drafter warm-starts a `model.architecture=dflash2` run (its backbone copied,
  the convolutions and the selector at their identity start, sized by the run's
  `model.conv_*` / `model.selector_*`), so the run starts drafting exactly what
  the DFlash drafter drafts, as the published Muse-Glimmer DFlash 2 started.

The mask token is the drafter's unless `model.mask_token_id` says otherwise
(`train.families.dflash.mask_token`). The directory is read once
(`train.fitting.start.read_source`: a `StartSource`) and that is what the run plans
and loads from. The run records where
it started: `model.init_from` in its config, and the directory and the sha256 of its
weights (`StartSource.record`) in
its checkpoints and exports. A resumed run takes the shape from its checkpoint
(the directory need not exist any more), under the same checks.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from train.config_error import ConfigError
from train.families.dflash.config import ModelConfig
from train.families.dflash.export import load_weights
from train.families.dflash.model import DFlashDrafter, DrafterConfig
from train.families.dflash.variants import kind_named
from train.families.family import StartSource


def fine_tune_config(
    source: DrafterConfig, where: str, model: ModelConfig, target, store_layer_ids, mask_token_id: int
) -> DrafterConfig:
    """`source` with the run's mask token, once it fits the run (module docstring);
    ConfigError naming the field otherwise. `where` names the source in messages
    ("--init-from DIR", or the checkpoint a resumed run continues)."""
    if warm_starts(source, model.architecture):  # the warm start (module docstring)
        source = warm_start_config(source, model)
    elif source.kind != kind_named(model.architecture):
        raise ConfigError(
            f"config model.architecture: {model.architecture}, but {where} is a {source.architecture} "
            f"drafter; set model.architecture={source.architecture} to fine-tune it"
        )
    if model.block_size is not None and source.block_size != model.block_size:
        raise ConfigError(
            f"config model.block_size: {model.block_size}, but {where} drafts blocks of "
            f"block_size {source.block_size}; set model.block_size={source.block_size}"
        )
    for name, wanted in (
        ("hidden_size", target.hidden_size),
        ("num_target_layers", target.num_hidden_layers),
        ("vocab_size", target.vocab_size),
    ):
        if getattr(source, name) != wanted:
            raise ConfigError(f"{where}: {name} {getattr(source, name)}, but the target and its store have {wanted}")
    missing = [layer for layer in source.context_layer_ids if layer not in store_layer_ids]
    if missing:
        raise ConfigError(
            f"{where}: dflash_config.target_layer_ids {list(source.context_layer_ids)} read layers "
            f"{missing} the store does not hold (it holds {list(store_layer_ids)}); extract a store "
            f"with them: `python -m extract run ... --layers-from {where.split()[-1]}` (with other "
            "drafters' directories after a comma, one store serves them all)"
        )
    if model.target_layer_ids is not None and list(model.target_layer_ids) != list(source.context_layer_ids):
        raise ConfigError(
            f"config model.target_layer_ids: {list(model.target_layer_ids)}, but {where} reads "
            f"{list(source.context_layer_ids)} (leave it unset to take the drafter's)"
        )
    for name, given in model.geometry().items():
        theirs = getattr(source, name)
        if given is not None and _plain(given) != _plain(theirs):
            key = "causal" if name == "is_causal" else name  # the run config's spelling
            raise ConfigError(
                f"config model.{key}: {given!r}, but {where} has {theirs!r} (leave it unset to take the drafter's)"
            )
    return dataclasses.replace(source, mask_token_id=mask_token_id)


def source_config(source: StartSource) -> DrafterConfig:
    """The --init-from drafter's config as the DFlash one it is (`train.fitting.build` refuses
    a source of another family before any family plans)."""
    return cast(DrafterConfig, source.config)


def warm_starts(source: DrafterConfig, architecture: str) -> bool:
    """Whether a drafter like `source` warm-starts one of kind `architecture` (a DFlash
    drafter a DFlash 2: train.families.dflash.variants' `warm_start_from`)."""
    return kind_named(architecture).warm_start_from == source.architecture


def warm_start_config(source: DrafterConfig, model: ModelConfig) -> DrafterConfig:
    """`source`'s config as the warm-started kind's: its backbone's shape, the kind's
    own sizes from the run's `model` section (unset ones: DrafterConfig's defaults,
    which a drafter of `source`'s kind holds untouched)."""
    kind = kind_named(model.architecture)
    sizes = {name: getattr(model, name) for name in kind.sizes if getattr(model, name) is not None}
    return dataclasses.replace(source, architecture=kind.name, **sizes)


def load_start_weights(drafter: DFlashDrafter, source: StartSource) -> DFlashDrafter:
    """The --init-from weights into the run's drafter: every tensor, or for a warm
    start (a DFlash 2 run from a DFlash drafter) the backbone, the new modules keeping
    their identity start."""
    warm = warm_starts(source_config(source), drafter.config.architecture)
    return load_weights(drafter, source.path, backbone_only=warm)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
