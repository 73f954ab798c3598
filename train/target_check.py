"""Is `--target` the checkpoint the store was extracted from? The one check `fit`,
`eval`, `speculate` and `serve-check` make before any work: the store's
fingerprint against the target directory's config and weights
(`Fingerprint.target_differences`, the comparison's one owner; no weight is loaded).
A drafter trained on one checkpoint's hidden states and served with another's
learns the wrong thing while every number looks plausible, so a mismatch is
refused by field; `--allow-other-target` accepts it deliberately, and the run
records that it did."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from store_schema.fingerprint import config_field_differences

ALLOW_FLAG = "--allow-other-target"
FULL_FLAG = "--full-weights-check"


class OtherTargetError(ValueError):
    """The target directory is not the store's target (exit 1); names each field."""

    def __init__(self, differences: dict, target: str | Path, store: str | Path, config_fields: Sequence[str] = ()):
        self.differences = differences
        fields = "; ".join(
            describe(name, have, got, target, config_fields) for name, (have, got) in differences.items()
        )
        super().__init__(
            f"--target {target} is not the checkpoint {store} was extracted from ({fields}); pass "
            f"{ALLOW_FLAG} to use it anyway (the run records it)"
        )


def describe(name: str, have, got, target, config_fields) -> str:
    """One difference in words: the config.json fields that differ where the store
    recorded its target's config (`Fingerprint.target_config`), else the two values."""
    if name == "target_config_sha256" and config_fields:
        shown = "; ".join(config_fields[:6]) + (
            f"; and {len(config_fields) - 6} more" if len(config_fields) > 6 else ""
        )
        return f"config.json fields (store's target -> {target}): {shown}"
    return f"{name}: store has {_short(have)}, {target} has {_short(got)}"


def check_target(
    store,
    target: str | Path,
    *,
    allow_other_target: bool = False,
    full: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Refuse (OtherTargetError) a `target` directory whose config or weights differ
    from what `store` (an open `store_schema.Store`) recorded, unless
    `allow_other_target`: then one warning line. Returns what a run records:
    {} when they match, else {"other_target": {field: [store's, target's]}}."""
    if full and not store.fingerprint.target_weights_sha256:
        raise ValueError(
            f"{FULL_FLAG}: {store.path} recorded no digest of every weight byte (extracted before "
            "stores kept one); without the flag the config, weight headers and sampled bytes are checked"
        )
    if full:
        log(f"checking every byte of {target}'s weights against the store's digest ({FULL_FLAG})")
    differences = store.fingerprint.target_differences(target, full=full)
    if not differences:
        return {}
    recorded = store.fingerprint.target_config
    config_fields = (
        config_field_differences(recorded, target) if recorded and "target_config_sha256" in differences else []
    )
    if not allow_other_target:
        raise OtherTargetError(differences, target, store.path, config_fields)
    log(
        f"warning: {target} differs from the target {store.path} was extracted from "
        f"({', '.join(differences)}); going on ({ALLOW_FLAG})"
    )
    return {"other_target": {name: list(pair) for name, pair in differences.items()}}


def _short(value) -> str:
    text = str(value)
    return repr(text[:12] + "...") if len(text) > 16 else repr(text)
