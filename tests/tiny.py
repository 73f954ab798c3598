"""The tiny drafter the CPU tests train, written once: its `key=value` overrides (as
`load_config` and `train fit --set` take them) and their command-line spelling."""

from __future__ import annotations

# The run's defaults (DFlash 2, D-PACE weights) at a tiny size: what the tests train is what
# `fit` trains. Tests about DFlash or decay weights set them (`DFLASH_DECAY`).
DRAFTER = (
    "model.num_hidden_layers=1",
    "model.block_size=8",
    "model.num_anchors=8",
    "model.selector_rank=16",
    "model.selector_top_k=8",
)
DFLASH_DECAY = ("model.architecture=dflash", "loss.position_weights=decay")
# The tiny targets' own attention shape (tests/builders.py: 4 heads x 16, 2 KV heads);
# without it the drafter takes the published geometry's head_dim 128.
TARGET_HEADS = ("model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16")


def drafter_sets(*extra: str, heads: bool = False) -> list[str]:
    """The tiny drafter's overrides (with `TARGET_HEADS` when `heads`); each `key=value`
    of `extra` replaces the setting of the same key in place, or is appended."""
    sets = [*DRAFTER, *(TARGET_HEADS if heads else ())]
    keys = [setting.split("=", 1)[0] for setting in sets]
    for setting in extra:
        key = setting.split("=", 1)[0]
        if key in keys:
            sets[keys.index(key)] = setting
        else:
            sets.append(setting)
            keys.append(key)
    return sets


def cli_sets(sets) -> list[str]:
    """`--set KEY=VALUE` for each override: how `train fit` takes them."""
    return [arg for setting in sets for arg in ("--set", setting)]
