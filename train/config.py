"""One typed config for a training run: dataclass sections, validated at load.

The sections of the parts that own them live beside them (`data`: train.data.config,
`model`: train.drafter.config, `eval`: train.acceptance.config); this file composes
them with the loop's own (`loss`, `optim`, `train`, `log`, read by `train.fitting`,
which builds a run from the whole config and so sits above this file).

    run = load_config("run.yaml", overrides=["optim.lr=3e-4", "num_anchors=256"])

Sources, later ones win: the dataclass defaults (the DFlash paper's recipe), a
YAML file, explicit CLI flags, then `--set key=value` overrides. A key is
`section.field` or, when unambiguous, the bare field name (`lr`, `num_anchors`).
Values given as strings are parsed as YAML scalars (`1e-3`, `true`, `null`,
`[0.9, 0.95]`) and then checked against the field's type. Every error names
the key. The resolved config is saved into the run directory as `config.yaml`
(and `config.json`), which is what `--resume` and `diagnose` read back.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from train.acceptance.config import EvalConfig
from train.config_error import ConfigError, require
from train.data.config import DataConfig
from train.drafter.config import LABELS, ModelConfig
from train.dtypes import dtype_name

CONFIG_FILE = "config.yaml"  # a run directory's saved config
NORMALIZE = ("step", "sequence")  # loss.normalize: over an optimizer step's weighted labels, or per sequence
POSITION_WEIGHTS = ("decay", "dpace")  # loss.position_weights: exp(-(k-1)/gamma), or D-PACE (arXiv 2605.18810)


@dataclass
class LossConfig:
    gamma: float | None = None  # slot weight exp(-(k-1)/gamma); None: 7 for B=16, 5 for B=10, 4 for B=8
    labels: str = "tokens"  # "tokens": the sequence's own tokens; "target": the store's target top-1
    kl_mix: float = 0.0  # weight of soft KL to the store's target top-k (0: hard CE, as DFlash trains)
    noise: float = 0.0  # uniform noise scale on the drafter's context features only (0: off)
    chunk_rows: int = 1024  # scored rows per loss chunk: peak ~ chunk_rows x vocab fp32 x 3
    normalize: str = "step"  # "step": over all weighted labels of an optimizer step (SpecForge); "sequence": per sequence
    # "dpace" (the default: ahead of "decay" for both drafters in benchmarks/drafter_bench.py):
    # D-PACE's dynamic weights, hard CE only; "decay": exp(-(k-1)/gamma)
    position_weights: str = "dpace"
    dpace_alpha: float = 0.5  # D-PACE confidence smoothing: (1 - alpha) q + alpha (the paper's and speculators' 0.5)
    selector_weight: float = 1.0  # DFlash 2: weight of the selector's K-way CE beside the main loss
    selector_warmup_steps: int = 0  # DFlash 2: linear ramp of selector_weight over the first steps (0: none)

    def validate(self):
        require(self.gamma is None or self.gamma > 0, "loss.gamma", "must be > 0")
        require(self.labels in LABELS, "loss.labels", 'must be "tokens" or "target"')
        require(0.0 <= self.kl_mix <= 1.0, "loss.kl_mix", "must be in [0, 1]")
        require(self.noise >= 0.0, "loss.noise", "must be >= 0")
        require(self.chunk_rows >= 1, "loss.chunk_rows", "must be >= 1")
        require(self.normalize in NORMALIZE, "loss.normalize", 'must be "step" or "sequence"')
        require(self.position_weights in POSITION_WEIGHTS, "loss.position_weights", 'must be "decay" or "dpace"')
        require(0.0 <= self.dpace_alpha <= 1.0, "loss.dpace_alpha", "must be in [0, 1]")
        require(self.position_weights != "dpace" or self.kl_mix == 0.0, "loss.position_weights", "dpace (the default) is hard CE only: with loss.kl_mix > 0 set loss.position_weights=decay")
        require(self.selector_weight >= 0.0, "loss.selector_weight", "must be >= 0")
        require(self.selector_warmup_steps >= 0, "loss.selector_warmup_steps", "must be >= 0")


@dataclass
class OptimConfig:
    lr: float = 6e-4
    warmup_fraction: float = 0.04  # of the total optimizer steps
    schedule: str = "cosine"  # "cosine" or "constant" (both after linear warmup)
    min_lr_ratio: float = 0.0  # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0  # SpecForge's DFlash optimizer (BF16Optimizer) uses 0
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's defaults, as SpecForge's DFlash training uses
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def validate(self):
        require(self.lr > 0, "optim.lr", "must be > 0")
        require(0.0 <= self.warmup_fraction < 1.0, "optim.warmup_fraction", "must be in [0, 1)")
        require(self.schedule in ("cosine", "constant"), "optim.schedule", "must be cosine or constant")
        require(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "must be two values in [0, 1)")
        require(self.eps > 0, "optim.eps", "must be > 0")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")


@dataclass
class TrainConfig:
    batch_size: int = 1  # sequences per micro-step (each is its own drafter forward)
    grad_accumulation: int = 8  # micro-steps per optimizer step: global batch batch_size x this = 8 sequences
    epochs: int = 6
    max_steps: int | None = None  # optimizer steps; None: as many as `epochs` give
    seed: int = 0
    dtype: str = "bfloat16"  # autocast dtype on CUDA: bfloat16 or float32 (not float16: no loss scaler); weights and optimizer stay fp32
    device: str = "auto"  # "auto": cuda if available, else cpu
    log_every: int = 10
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2  # newest checkpoints kept (0: keep all)
    progress_interval: float = 30.0  # seconds between progress lines when stderr is not a terminal

    def validate(self):
        require(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        require(self.grad_accumulation >= 1, "train.grad_accumulation", "must be >= 1")
        require(self.epochs >= 1, "train.epochs", "must be >= 1")
        require(self.max_steps is None or self.max_steps >= 1, "train.max_steps", "must be >= 1")
        try:
            self.dtype = dtype_name(self.dtype)
        except ValueError as error:
            raise ConfigError(f"config train.dtype: {error}") from None
        # fp16's 5-bit exponent underflows small gradients without a loss scaler, which this
        # trainer does not have: bf16 trains without one (same exponent range as fp32).
        require(self.dtype != "float16", "train.dtype",
               "float16 is refused: training in it needs a loss scaler; use bfloat16 (or float32)")
        require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"), "train.device", "must be auto, cpu or cuda[:N]")
        for name in ("log_every", "checkpoint_every", "keep_checkpoints"):
            require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0")
        require(self.log_every >= 1, "train.log_every", "must be >= 1")
        require(self.progress_interval >= 0, "train.progress_interval", "must be >= 0 (seconds)")

    @property
    def sequences_per_step(self) -> int:
        """The global batch: sequences per optimizer step."""
        return self.batch_size * self.grad_accumulation


@dataclass
class LogConfig:
    tensorboard: bool = False  # also write the logged metrics as TensorBoard events under RUN/tb/ (JSONL stays the record)
    samples: bool = False  # each rank writes RUN/samples/rank-<r>.jsonl: every trained sample's step, lane, epoch, id

    def validate(self):
        return self


@dataclass
class RunConfig:
    store: str = ""  # the hidden-state store (store_schema)
    target: str = ""  # target model directory: config.json, safetensors, tokenizer
    out: str = ""  # run directory: config, train_log.jsonl, checkpoints/
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self, require_paths: bool = True) -> "RunConfig":
        for name in ("store", "target", "out") if require_paths else ():
            require(bool(getattr(self, name)), name, "is required")
        for section in SECTIONS:
            getattr(self, section).validate()
        return self

    def to_dict(self) -> dict:
        """Plain JSON/YAML data (tuples as lists)."""
        return dataclasses.asdict(self, dict_factory=lambda items: {k: _plain(v) for k, v in items})

    def save(self, run_dir: str | Path) -> None:
        """RUN/config.yaml (what `--resume` and `diagnose` read) and a JSON copy."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(data, sort_keys=False))
        (run_dir / "config.json").write_text(json.dumps(data, indent=2) + "\n")


SECTIONS = ("data", "model", "loss", "optim", "train", "eval", "log")
_SECTION_TYPES = {name: f.type for name, f in ((f.name, f) for f in dataclasses.fields(RunConfig))}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


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
    return ["store", "target", "out"] + [f"{s}.{name}" for s in SECTIONS for name in _field_types(type(getattr(RunConfig(), s)))]


def did_you_mean(key: str) -> str:
    """' (did you mean optim.lr?)' for the known keys closest to `key`, else ''."""
    keys = known_keys()
    bare = {k.split(".")[-1]: k for k in keys}
    close = difflib.get_close_matches(key, keys, n=2, cutoff=0.6)
    close += [bare[m] for m in difflib.get_close_matches(key.split(".")[-1], list(bare), n=2, cutoff=0.6)
              if bare[m] not in close]
    return f" (did you mean {' or '.join(close[:2])}?)" if close else ""


def _resolve_key(key: str) -> tuple[str | None, str]:
    """'optim.lr' -> ('optim', 'lr'); 'lr' -> ('optim', 'lr') when only one section has it.
    Older spellings (RENAMED_KEYS, e.g. in a saved run's config) map to today's."""
    key = RENAMED_KEYS.get(key, key)
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"config {key}: unknown section {section!r} (sections: {', '.join(SECTIONS)})"
                              f"{did_you_mean(key)}")
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
                raise ConfigError(f"{where}: top-level {key!r} and {full} are both set (did you mean {full}? "
                                  f"remove the top-level {key!r})")
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
            raise ConfigError(f"{path} line {error.lineno}, column {error.colno}: not valid JSON: {error.msg}") from None
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
