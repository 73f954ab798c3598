"""`python -m train serve-check --drafter DIR --target PATH (--store STORE | --prompts FILE)
[--limit K] [--max-new-tokens N] [--json] ...`

Served as trained: decodes the prompts greedily three ways (the target alone in
transformers, this project's `speculate`, and vLLM with the drafter as its DFlash
speculator) and reports per prompt and overall `lossless` (vLLM's output equals the
target's greedy output, up to a stop token), `served_tau` (1 + accepted / drafts from
vLLM's spec-decode metrics), `served_per_position`, `speculate_tokens_per_round`,
`speculate_tau`, both sides' tokens per round counted the same way and their
relative difference. Exit 1 when not lossless or when that difference exceeds 5 %.
vLLM runs in a subprocess: this python when it imports vLLM, else the project's
`.venv-vllm` (`make vllm-env`), or --vllm-python. On CPU its memory share is sized
from what its engine needs (train/serving/vllm_memory.py); its request, result and
log stay in DRAFTER/serve-check/, and a failed engine is one line: vLLM's own first
error and that log's path."""

from __future__ import annotations

from store_schema.runtime.hub import model_dir_arg
from train.cli import add_target_flags, dtype_arg, fraction_arg, positive_int
from train.cli.speculate import add_sampling_flags, add_thinking_flag
from train.data.config import SPLITS
from train.dtypes import NAMES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-check",
        help="serve the drafter with vLLM: lossless, served tau vs speculate's",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--drafter",
        required=True,
        type=model_dir_arg,
        help="exported drafter directory, a run directory holding one, or a cached hub id",
    )
    p.add_argument("--target", required=True, type=model_dir_arg, help="target model directory (or a cached hub id)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--store", help="decode the store's held-out samples' prompts (a directory or s3://bucket/prefix)"
    )
    source.add_argument(
        "--prompts",
        metavar="SET[,SET...]",
        help="prompt sets, comma-separated: `humaneval` or JSONL files (as `speculate --prompts`)",
    )
    p.add_argument("--limit", type=positive_int, help="decode at most this many prompts (default: all)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--split", choices=SPLITS, default="heldout", help="store samples to take (default heldout)")
    p.add_argument(
        "--heldout-fraction",
        type=fraction_arg,
        help="share of samples in the held-out split (default: the run's, as the export records it)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS / end-of-turn tokens")
    p.add_argument("--device", help="device of this project's decoding: cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=NAMES,
        help="dtype of both decodings (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--vllm-python",
        help="python of an environment with vLLM (default: this one when it imports "
        "vLLM, else .venv-vllm/bin/python; also $DFLASH_VLLM_PYTHON)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=fraction_arg,
        help="vLLM's memory share (default on CPU, where it is a share of host memory: sized from the "
        "weights, the KV cache of the longest reply and vLLM's overhead; 0.9 on GPU)",
    )
    p.add_argument(
        "--workdir",
        help="where vLLM's request, result and log are kept (default: DRAFTER/serve-check, DRAFTER being --drafter)",
    )
    add_thinking_flag(p)
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (last line) instead of the table")
    add_target_flags(p)
    p.set_defaults(handler="train.commands.serve_check:run")
