"""`python -m train export RUN --out DIR [--dtype bfloat16|float16|float32]
[--checkpoint PATH]`: the run's newest (or the given) checkpoint's drafter in
z-lab's DFlash format (config.json + model.safetensors, no target tensors), with
the run's held-out split recorded in config.json (`heldout_split`) and how the
run started (`mask_token_rule`: which rule chose the mask token)."""

from __future__ import annotations

import json
from pathlib import Path

from train.cli import dtype_arg
from train.dtypes import NAMES, torch_dtype


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a run's drafter in z-lab's DFlash format", description=__doc__)
    p.add_argument("run", help="run directory")
    p.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg, choices=NAMES,
                   help="dtype of the exported weights (published drafters are bf16; bf16/fp16/fp32 accepted too)")
    p.set_defaults(handler=run)


def refuse_store_dir(out: str | Path) -> None:
    """An export never goes into a hidden-state store (a directory holding a Zarr
    root, or one inside it): its files would sit among the store's shards."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.layout import ZARR_METADATA

    resolved = Path(out).resolve()
    for directory in (resolved, *resolved.parents):
        if (directory / ZARR_METADATA).is_file():
            raise ValueError(f"export --out {out}: {directory} is a hidden-state store (it holds {ZARR_METADATA}); "
                             "export into a directory outside it")


def run(args) -> int:
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from train.data.heldout import heldout_fraction_of, heldout_record
    from train.drafter.build import build_drafter
    from train.drafter.model import DrafterConfig
    from train.export.drafter_dir import export_drafter
    from train.fitting import checkpoint as ckpt

    refuse_store_dir(args.out)
    path = Path(args.checkpoint) if args.checkpoint else ckpt.latest_checkpoint(args.run)
    if path is None:
        raise FileNotFoundError(f"{args.run}: no checkpoint to export")
    state = ckpt.read_state(path)
    drafter = build_drafter(DrafterConfig.from_dict(state["drafter_config"]))
    drafter.load_state_dict(ckpt.load_model_weights(path), strict=True)
    # Checkpoints written before the split was recorded used the same rule at the config's fraction.
    split = state.get("heldout_split") or heldout_record(state["config"]["data"]["heldout_fraction"])
    fraction = heldout_fraction_of(split, f"{path} heldout_split")
    # How the run started (the rule that chose the mask token, ...) goes along as top-level keys.
    out = export_drafter(drafter, args.out, dtype=torch_dtype(args.dtype), heldout_fraction=fraction,
                         extra_config=state.get("run_info"))
    print(json.dumps({"exported": str(out), "checkpoint": str(path), "step": state["step"], "dtype": args.dtype,
                      "heldout_fraction": fraction}))
    return 0
