"""Where a fine-tuning run starts (`fit --init-from DIR`): DIR is a drafter directory
(an export, or a published drafter a family reads), one of this trainer's checkpoints
(`state.json` + `model.safetensors`), or a run directory (its newest checkpoint).
It is read once (`read_source`: a `StartSource`); the drafter's family checks that
it fits the run and loads it (DFlash: `train.families.dflash.init_from`)."""

from __future__ import annotations

from pathlib import Path

from train.families.family import WEIGHTS, StartSource
from train.families.kinds import config_from_state, exported_classes, family_of_export
from train.fitting import checkpoint as ckpt


def source_dir(path: str | Path) -> Path:
    """The directory whose weights a run starts from: `path` itself when it holds
    them (a drafter directory or a checkpoint), else the newest checkpoint of the run `path`."""
    path = Path(path)
    latest = ckpt.latest_checkpoint(path) if path.is_dir() and not (path / WEIGHTS).is_file() else None
    return latest or path


def read_source(path: str | Path) -> StartSource:
    """`path`'s drafter: a drafter directory (its family's reader), a checkpoint (its
    `drafter_config`) or a run (its newest checkpoint)."""
    found = source_dir(path)
    if (found / WEIGHTS).is_file() and (found / "config.json").is_file():
        return StartSource(found, family_of_export(found).read_export_config(found))
    try:
        return StartSource(found, config_from_state(ckpt.read_state(found)))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--init-from {path}: not a drafter directory (config.json naming {exported_classes()} "
            f"and {WEIGHTS}), a checkpoint or a run with one"
        ) from None
