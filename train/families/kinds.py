"""The drafter families, one registry: the architecture a config names (or an
export's config.json) leads here to its family (`train.families.family`), and nothing
outside `train/families/` tells families apart by name."""

from __future__ import annotations

import json
from pathlib import Path

from train.families.dflash.family import DFlashFamily
from train.families.eagle3.family import Eagle3Family
from train.families.family import DrafterFamily

FAMILIES: tuple[DrafterFamily, ...] = (DFlashFamily(), Eagle3Family())
LEGACY_ARCHITECTURE = "dflash"  # what a checkpoint written before families recorded none trained
BY_ARCHITECTURE = {variant: family for family in FAMILIES for variant in family.variants}


def family_named(architecture: str) -> DrafterFamily:
    """The family that builds `architecture`; ValueError listing the architectures otherwise."""
    try:
        return BY_ARCHITECTURE[architecture]
    except KeyError:
        raise ValueError(f"architecture must be one of {', '.join(BY_ARCHITECTURE)}, got {architecture!r}") from None


def family_of(drafter) -> DrafterFamily:
    """The family of a drafter (bare or under a DDP replica) or of a drafter config."""
    config = getattr(getattr(drafter, "module", drafter), "config", drafter)
    return family_named(config.architecture)


def config_from_state(state: dict):
    """The drafter config a checkpoint's state.json records (`drafter_config`)."""
    data = state["drafter_config"]
    return family_named(data.get("architecture", LEGACY_ARCHITECTURE)).config_from_dict(data)


def claims_export(data: dict) -> bool:
    """Whether a family reads a drafter directory whose config.json holds `data`."""
    return any(family.claims_export(data) for family in FAMILIES)


def exported_classes() -> str:
    """The config.json `architectures` the families read, for messages."""
    return " / ".join(name for family in FAMILIES for name in family.exported_classes)


def family_of_export(model_dir: Path) -> DrafterFamily:
    """The family that reads the drafter directory `model_dir` (its config.json's
    `architectures`); ValueError naming the file and the classes the families read."""
    path = model_dir / "config.json"
    data = json.loads(path.read_text())
    found = next((family for family in FAMILIES if family.claims_export(data)), None)
    if found is None:
        raise ValueError(f"{path}: architectures {data.get('architectures')} not supported ({exported_classes()})")
    return found
