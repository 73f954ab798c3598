"""The run's `model` and `loss` sections, composed from the drafter families' own
(`train/families/<family>/config.py`): `model.architecture` picks the family whose
rules check the section, and a key only another family reads, set away from its
default, is refused by name (a DFlash `block_size` given to an EAGLE-3 run would
otherwise be silently ignored)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from train.config_error import ConfigError
from train.families.dflash.config import ARCHITECTURES as DFLASH_ARCHITECTURES
from train.families.dflash.config import LossConfig
from train.families.dflash.config import ModelConfig as DFlashModelConfig
from train.families.eagle3.config import ARCHITECTURE as EAGLE3
from train.families.eagle3.config import Eagle3Fields

__all__ = ["LossConfig", "ModelConfig"]

# Keys every family reads: which one, where it starts, the target's geometry it may override.
COMMON_MODEL_KEYS = (
    "architecture",
    "target_layer_ids",
    "init_from",
    "gradient_checkpointing",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)
OWN_KEYS = {
    **{kind: tuple(f.name for f in fields(DFlashModelConfig)) for kind in DFLASH_ARCHITECTURES},
    EAGLE3: tuple(f.name for f in fields(Eagle3Fields)),
}


@dataclass
class ModelConfig(DFlashModelConfig, Eagle3Fields):
    """Every family's `model` keys; `architecture` says whose rules apply."""

    def validate(self):
        if self.architecture not in OWN_KEYS:
            raise ConfigError(
                f"config model.architecture: must be one of {', '.join(OWN_KEYS)}, got {self.architecture!r}"
            )
        if self.architecture == EAGLE3:
            self.validate_eagle3()
        else:
            DFlashModelConfig.validate(self)
        default = ModelConfig()
        foreign = [
            f.name
            for f in fields(self)
            if f.name not in COMMON_MODEL_KEYS + OWN_KEYS[self.architecture]
            and getattr(self, f.name) != getattr(default, f.name)
        ]
        if foreign:
            raise ConfigError(
                f"config model.{foreign[0]}: model.architecture {self.architecture} does not read it "
                f"(set only for {', '.join(name for name, keys in OWN_KEYS.items() if foreign[0] in keys)})"
            )
