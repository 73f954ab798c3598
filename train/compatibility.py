"""Does a store, a target and a drafter belong together? Every such check of `fit`,
`eval`, `speculate` and `serve-check`, one rule and one message each. (Whether
`--target` is the very checkpoint the store was extracted from is
`train.target_check`'s, which these commands call first.)"""

from __future__ import annotations

from store_schema.runtime.target_config import TargetConfig
from train.config_error import ConfigError


def check_store_against_target(store, target: TargetConfig) -> None:
    """Refuse a store made from another target (FingerprintMismatch naming each
    differing field). A store holding the target's final layer never gets here: its
    fingerprint is refused when the store is opened (`store_schema.layout.validate_layer_ids`)."""
    store.fingerprint.check(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=target.num_hidden_layers
    )


def check_drafter_against_target(drafter_config, hidden_size: int, vocab_size: int, num_layers: int, where) -> None:
    """Refuse a drafter made for another target (ValueError naming the field); `where`
    names the drafter in the message."""
    checks = {
        "hidden_size": (drafter_config.hidden_size, hidden_size),
        "vocab_size": (drafter_config.vocab_size, vocab_size),
        "num_target_layers": (drafter_config.num_target_layers, num_layers),
    }
    for name, (drafter_value, target_value) in checks.items():
        if drafter_value != target_value:
            raise ValueError(f"{where}: drafter {name} {drafter_value} does not match the target's {target_value}")


def check_drafter_against_store(drafter_config, vocab_size: int, store) -> None:
    """Refuse a store the drafter cannot read: another target's (hidden size, layer
    count, vocabulary) or one lacking the drafter's context layers."""
    store.fingerprint.check(
        hidden_size=drafter_config.hidden_size,
        num_target_layers=drafter_config.num_target_layers,
        vocab_size=vocab_size,
    )
    store.require_layers(drafter_config.context_layer_ids)


def check_topk(store, needed_by: list[str]) -> None:
    """The target's top-k predictions, which `needed_by` (the settings, by name) read,
    must be in the store (ConfigError naming them)."""
    if needed_by and not store.fingerprint.target_topk:
        raise ConfigError(
            f"config {' / '.join(needed_by)} need the target's top-k in the store; {store.path} was extracted "
            "without it (extract with --target-topk K)"
        )
