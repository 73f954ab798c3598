"""One typed config for a training run: dataclass sections, validated at load.

Each section lives beside the part that owns it (`data`: train.data.config, `model` and
`loss`: train.families.config, composed from the drafter families' own, `eval`:
train.evaluation.config, `optim`, `train`, `log`: train.fitting.config); this file only
composes them.
`train.config_loading.load_config` reads one from a file, flags and `--set` overrides;
`RunConfig.save` writes the resolved config into the run directory as `config.yaml`
(and `config.json`), which is what `--resume` and `diagnose` read back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from train.config_error import require
from train.data.config import DataConfig
from train.evaluation.config import EvalConfig
from train.families.config import LossConfig, ModelConfig
from train.fitting.config import LogConfig, OptimConfig, TrainConfig

CONFIG_FILE = "config.yaml"  # a run directory's saved config


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


def _plain(value):
    return list(value) if isinstance(value, tuple) else value
