"""The drafter a config names: its kind's class (train.drafter.kinds)."""

from __future__ import annotations

from train.drafter.dflash2 import DFlash2Drafter
from train.drafter.model import DFlashDrafter, DrafterConfig

CLASSES = {cls.kind.name: cls for cls in (DFlashDrafter, DFlash2Drafter)}


def build_drafter(config: DrafterConfig) -> DFlashDrafter:
    """A fresh drafter of the kind `config.architecture` names."""
    return CLASSES[config.architecture](config)
