"""A drafter directory (`config.json` + `model.safetensors`) of any family: written
and read through the family the drafter's architecture names (`train.families.kinds`),
each in the format its engines load (DFlash: `train.families.dflash.export`; EAGLE-3: `train.families.eagle3.export`).

An export of this trainer also records, under the top-level key `heldout_split`
(which other loaders ignore), how the run split its samples: `{"fraction": f,
"rule": "sha256(sample_id)[:8] / 2**64 < fraction"}`, so that `python -m train
eval` evaluates exactly the samples the run never trained on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from train.data.config import DataConfig
from train.data.heldout import heldout_fraction_of, heldout_record
from train.families.family import Drafter
from train.families.kinds import claims_export, exported_classes, family_of, family_of_export

HELDOUT_SPLIT_KEY = "heldout_split"


def export_drafter(
    drafter: Drafter,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    extra_config: dict | None = None,
    heldout_fraction: float | None = None,
) -> Path:
    """Write `config.json` and `model.safetensors` for `drafter` into `out_dir`.

    dtype: weights' dtype on disk (bf16, as published drafters are).
    extra_config: more top-level config keys (e.g. bos/eos token ids, provenance).
    heldout_fraction: the run's `data.heldout_fraction`, recorded with the split
    rule under `heldout_split` (None: not recorded)."""
    extra = dict(extra_config or {})
    if heldout_fraction is not None:
        extra[HELDOUT_SPLIT_KEY] = heldout_record(heldout_fraction)
    return family_of(drafter).export(drafter, Path(out_dir), dtype, extra)


def read_drafter_config(model_dir: str | Path):
    """The drafter config of an exported (or published) drafter's config.json."""
    return family_of_export(Path(model_dir)).read_export_config(Path(model_dir))


def load_drafter(model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Rebuild the drafter of an exported or published directory (strict: every
    weight present, nothing extra). dtype None keeps the dtype stored on disk."""
    return family_of_export(Path(model_dir)).load(Path(model_dir), dtype, device)


def read_heldout_fraction(model_dir: str | Path) -> float | None:
    """The held-out fraction an export recorded (`heldout_split`), or None for a
    drafter directory without one (e.g. a published z-lab drafter)."""
    path = Path(model_dir) / "config.json"
    record = json.loads(path.read_text()).get(HELDOUT_SPLIT_KEY)
    return None if record is None else heldout_fraction_of(record, f"{path} {HELDOUT_SPLIT_KEY}")


def heldout_fraction(split: str, given: float | None, drafter_dir: Path) -> float | None:
    """The held-out fraction `eval` / `speculate` split a store by: `given`
    (--heldout-fraction), else the export's record, else the trainer's default (with a
    note); None for `split` all."""
    if split == "all":
        return None
    if given is not None:
        return given
    recorded = read_heldout_fraction(drafter_dir)
    if recorded is not None:
        return recorded
    default = DataConfig.heldout_fraction
    print(
        f"note: {drafter_dir / 'config.json'} records no held-out split (not exported by this trainer); "
        f"using the trainer's default fraction {default}; pass --heldout-fraction to set the training run's",
        file=sys.stderr,
    )
    return default


def resolve_drafter_dir(path: str | Path) -> Path:
    """An exported drafter directory (config.json a family claims + model.safetensors),
    given either that directory or a run directory holding exports below it (the
    most recently written one is taken)."""
    path = Path(path)

    def is_export(p: Path) -> bool:
        config = p / "config.json"
        if not (config.is_file() and (p / "model.safetensors").is_file()):
            return False
        try:
            return claims_export(json.loads(config.read_text()))
        except ValueError:
            return False

    if is_export(path):
        return path
    found = [p.parent for p in path.glob("**/config.json") if is_export(p.parent)]
    if not found:
        raise FileNotFoundError(not_a_drafter(path))
    return max(found, key=lambda p: (p / "model.safetensors").stat().st_mtime)


def not_a_drafter(path: Path) -> str:
    """Why `path` holds no drafter, and what fixes it: a published drafter's download
    lacks its weights (fetch it again), a run has checkpoints to export, else neither."""
    config = path / "config.json"
    if config.is_file() and not (path / "model.safetensors").is_file():
        return f"{path}: config.json without model.safetensors beside it (an incomplete download? fetch it again)"
    if config.is_file():
        return f"{path}: its config.json is no drafter this trainer reads (architectures {exported_classes()})"
    if any(path.glob("**/state.json")):
        return f"{path}: a run without an exported drafter; export a checkpoint first (python -m train export)"
    return (
        f"{path}: no drafter directory (config.json + model.safetensors) here or below, "
        "and no run with checkpoints to export"
    )
