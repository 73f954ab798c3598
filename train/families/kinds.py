"""The drafter families, one registry: the architecture a config names (or an
export's config.json) leads here to its family (`train.families.family`), and nothing
outside `train/families/` tells families apart by name."""

from __future__ import annotations

from train.families.dflash.family import DFlashFamily
from train.families.family import DrafterFamily

FAMILIES: tuple[DrafterFamily, ...] = (DFlashFamily(),)
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
