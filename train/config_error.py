"""The one error a config's keys raise, and the check that raises it naming the key.
Below every folder of `train/` (the drafter's mask-token rule raises it too), so that
`train/config.py`, which composes the sections, can stand above the drafter's shape rule."""


class ConfigError(ValueError):
    """A config key is unknown, mistyped or out of range; the message names it."""


def require(ok: bool, key: str, message: str) -> None:
    """Refuse config key `key` with `message` unless `ok`."""
    if not ok:
        raise ConfigError(f"config {key}: {message}")
