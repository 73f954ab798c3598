"""Reading a run config: YAML/JSON files, explicit values and `--set key=value`
overrides, each key resolved to its section and checked against the field's type.

    run = load_config("run.yaml", overrides=["optim.lr=3e-4", "num_anchors=256"])

Sources, later ones win: the dataclass defaults (the DFlash paper's recipe), a
YAML file, explicit CLI flags, then `--set key=value` overrides. A key is
`section.field` or, when unambiguous, the bare field name (`lr`, `num_anchors`).
Values given as strings are parsed as YAML scalars (`1e-3`, `true`, `null`,
`[0.9, 0.95]`) and then checked against the field's type. Every error names
the key. `RunConfig.save` writes the resolved config into the run directory as
`config.yaml` (and `config.json`), which is what `--resume` and `diagnose` read back.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from pathlib import Path

import yaml

from train.config import SECTIONS, RunConfig
from train.config_error import ConfigError


def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def _coerce(key: str, value, annotation):
    """Check (and gently convert) `value` to `annotation`; ConfigError naming `key`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"config {key}: cannot be {value!r}")
    args = typing.get_args(annotation)
    if origin is list or (origin is tuple and args[1:] == (Ellipsis,)):  # list[str], tuple[int, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config {key}: expected a list, got {value!r}")
        items = [_coerce(key, v, args[0]) for v in value]
        return items if origin is list else tuple(items)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"config {key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config {key}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config {key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config {key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
        raise ConfigError(f"config {key}: expected a string, got {value!r}")
    raise ConfigError(f"config {key}: unsupported type {annotation!r}")


RENAMED_KEYS = {"model.num_layers": "model.num_hidden_layers", "num_layers": "model.num_hidden_layers"}


def known_keys() -> list[str]:
    """Every key a config accepts, spelled `section.field` (and the three paths)."""
    return ["store", "target", "out"] + [
        f"{s}.{name}" for s in SECTIONS for name in _field_types(type(getattr(RunConfig(), s)))
    ]


# The names other trainers (transformers' TrainingArguments, SpecForge, speculators) give
# the same settings: a key spelled so is pointed at this config's own.
FIELD_NAMES_ELSEWHERE = {
    "learning_rate": "optim.lr",
    "lr_scheduler_type": "optim.schedule",
    "warmup_ratio": "optim.warmup_fraction",
    "max_grad_norm": "optim.grad_clip",
    "adam_epsilon": "optim.eps",
    "gradient_accumulation_steps": "train.grad_accumulation",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "per_device_train_batch_size": "train.batch_size",
    "logging_steps": "train.log_every",
    "save_steps": "train.checkpoint_every",
    "save_total_limit": "train.keep_checkpoints",
    "eval_steps": "eval.every",
    "max_seq_length": "data.max_length",
    "max_len": "data.max_length",
    "num_draft_layers": "model.num_hidden_layers",
    "target_layers": "model.target_layer_ids",
}


def did_you_mean(key: str) -> str:
    """' (did you mean optim.lr?)' for the key another trainer names so (`FIELD_NAMES_ELSEWHERE`),
    else the known keys closest to `key`, else ''."""
    elsewhere = FIELD_NAMES_ELSEWHERE.get(key.split(".")[-1])
    if elsewhere:
        return f" (did you mean {elsewhere}?)"
    keys = known_keys()
    bare = {k.split(".")[-1]: k for k in keys}
    close = difflib.get_close_matches(key, keys, n=2, cutoff=0.6)
    close += [
        bare[m]
        for m in difflib.get_close_matches(key.split(".")[-1], list(bare), n=2, cutoff=0.6)
        if bare[m] not in close
    ]
    return f" (did you mean {' or '.join(close[:2])}?)" if close else ""


def _resolve_key(key: str) -> tuple[str | None, str]:
    """'optim.lr' -> ('optim', 'lr'); 'lr' -> ('optim', 'lr') when only one section has it.
    Older spellings (RENAMED_KEYS, e.g. in a saved run's config) map to today's."""
    key = RENAMED_KEYS.get(key, key)
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(
                f"config {key}: unknown section {section!r} (sections: {', '.join(SECTIONS)}){did_you_mean(key)}"
            )
        if name not in _field_types(type(getattr(RunConfig(), section))):
            raise ConfigError(f"config {key}: unknown key {name!r} in section {section!r}{did_you_mean(key)}")
        return section, name
    if key in ("store", "target", "out"):
        return None, key
    owners = [s for s in SECTIONS if key in _field_types(type(getattr(RunConfig(), s)))]
    if not owners:
        raise ConfigError(f"config {key}: unknown key{did_you_mean(key)}")
    if len(owners) > 1:
        raise ConfigError(f"config {key}: ambiguous, say {' or '.join(f'{s}.{key}' for s in owners)}")
    return owners[0], key


def _apply(config: RunConfig, key: str, value) -> None:
    section, name = _resolve_key(key)
    target = config if section is None else getattr(config, section)
    annotation = _field_types(type(target))[name]
    shown = name if section is None else f"{section}.{name}"
    setattr(target, name, _coerce(shown, value, annotation))


def _yaml_error(path, error: yaml.YAMLError) -> ConfigError:
    """Where and what, without PyYAML's quoted excerpt of the file (the location says where)."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = "; ".join(p for p in (getattr(error, "context", None), getattr(error, "problem", None)) if p)
    return ConfigError(f"{path}{where}: not valid YAML: {problem or str(error).splitlines()[0]}")


def _apply_mapping(config: RunConfig, data: dict, where: str) -> None:
    """A file's keys. A bare key beside its own section's spelling (`lr:` and
    `optim: lr:`) is refused: which one wins would be an accident of order."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    sectioned = {f"{k}.{name}" for k, v in data.items() if k in SECTIONS and isinstance(v, dict) for name in v}
    for key in data:
        if key not in SECTIONS and "." not in str(key) and str(key) not in ("store", "target", "out"):
            owner = _resolve_key(str(key))
            full = f"{owner[0]}.{owner[1]}"
            if full in sectioned:
                raise ConfigError(
                    f"{where}: top-level {key!r} and {full} are both set (did you mean {full}? "
                    f"remove the top-level {key!r})"
                )
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: section {key!r} must be a mapping")
            for name, inner in value.items():
                _apply(config, f"{key}.{name}", inner)
        else:
            _apply(config, key, value)


def check_override(text: str) -> None:
    """Refuse a `--set` that is not KEY=VALUE of a known key (ConfigError naming it)."""
    key, _ = parse_override(text)
    _resolve_key(key)


def parse_override(text: str) -> tuple[str, object]:
    """'key=value' -> (key, value parsed as a YAML scalar/list)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict | None = None, *, require_paths: bool = True, **explicit
) -> RunConfig:
    """Defaults <- YAML file <- explicit keyword values (None ignored) <- overrides;
    validated. `require_paths=False` accepts a config without store/target/out
    (e.g. a run.yaml whose paths come from flags, read only for its settings)."""
    config = RunConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        text = path.read_text()
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{path} line {error.lineno}, column {error.colno}: not valid JSON: {error.msg}"
            ) from None
        except yaml.YAMLError as error:
            raise _yaml_error(path, error) from None
        _apply_mapping(config, data or {}, str(path))
    for key, value in explicit.items():
        if value is not None:
            _apply(config, key, value)
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides or ())
    for key, value in items:
        _apply(config, key, value)
    return config.validate(require_paths)
