"""The drafter a config names: its kind's class (train.families.dflash.variants)."""

from __future__ import annotations

from train.families.dflash.dflash2 import DFlash2Drafter
from train.families.dflash.model import DFlashDrafter, DrafterConfig

CLASSES = {cls.kind.name: cls for cls in (DFlashDrafter, DFlash2Drafter)}


def build_drafter(config: DrafterConfig) -> DFlashDrafter:
    """A fresh drafter of the kind `config.architecture` names."""
    return CLASSES[config.architecture](config)
