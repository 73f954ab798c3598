"""`python -m train export RUN --out DIR [--dtype bfloat16|float16|float32]
[--checkpoint PATH]`: the run's newest (or the given) checkpoint's drafter in
z-lab's DFlash format (config.json + model.safetensors, no target tensors), with
the run's held-out split recorded in config.json (`heldout_split`) and how the
run started (`mask_token_rule`: which rule chose the mask token)."""

from __future__ import annotations

from train.cli import dtype_arg
from train.dtypes import NAMES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a run's drafter in z-lab's DFlash format", description=__doc__)
    p.add_argument("run", help="run directory")
    p.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        type=dtype_arg,
        choices=NAMES,
        help="dtype of the exported weights (published drafters are bf16; bf16/fp16/fp32 accepted too)",
    )
    p.set_defaults(handler="train.commands.export:run")
