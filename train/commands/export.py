"""`python -m train export`'s handler (its parser: train/cli/export.py). Imported only
when the command runs, so it imports at the top."""

from __future__ import annotations

import json
from pathlib import Path

from store_schema.layout import ZARR_METADATA
from train.data.heldout import heldout_fraction_of, heldout_record
from train.dtypes import torch_dtype
from train.export.drafter_dir import export_drafter
from train.families.kinds import config_from_state, family_of
from train.fitting import checkpoint as ckpt
from train.fitting.store_projection import checkpoint_directions, fold_into
from train.tensor_files import CHECKPOINT_FIX, read_tensors


def refuse_store_dir(out: str | Path) -> None:
    """An export never goes into a hidden-state store (a directory holding a Zarr
    root, or one inside it): its files would sit among the store's shards."""
    resolved = Path(out).resolve()
    for directory in (resolved, *resolved.parents):
        if (directory / ZARR_METADATA).is_file():
            raise ValueError(
                f"export --out {out}: {directory} is a hidden-state store (it holds {ZARR_METADATA}); "
                "export into a directory outside it"
            )


def run(args) -> int:
    refuse_store_dir(args.out)
    path = Path(args.checkpoint) if args.checkpoint else ckpt.latest_checkpoint(args.run)
    if path is None:
        raise FileNotFoundError(f"{args.run}: no checkpoint to export")
    state = ckpt.read_state(path)
    config = config_from_state(state)
    drafter = family_of(config).build(config)
    drafter.load_state_dict(ckpt.load_model_weights(path), strict=True)
    if "projection" in state:  # trained on a projected store: the export reads raw states
        family = family_of(config)
        directions = checkpoint_directions(read_tensors(path / ckpt.PARTS["projection"][1], CHECKPOINT_FIX))
        fold_into(family.context_map(drafter), list(config.context_layer_ids), directions)
    # Checkpoints written before the split was recorded used the same rule at the config's fraction.
    split = state.get("heldout_split") or heldout_record(state["config"]["data"]["heldout_fraction"])
    fraction = heldout_fraction_of(split, f"{path} heldout_split")
    # How the run started (the rule that chose the mask token, ...) goes along as top-level keys.
    out = export_drafter(
        drafter, args.out, dtype=torch_dtype(args.dtype), heldout_fraction=fraction, extra_config=state.get("run_info")
    )
    print(
        json.dumps(
            {
                "exported": str(out),
                "checkpoint": str(path),
                "step": state["step"],
                "dtype": args.dtype,
                "heldout_fraction": fraction,
            }
        )
    )
    return 0
