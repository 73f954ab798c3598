"""Drafter training attention on CPU: the split path (context and own block attended
apart, one softmax; train/families/dflash/attention.py) against dense SDPA over
`[context | every block]` with a materialised mask.

    python benchmarks/attention_bench.py [--quick | --smoke] [--rounds R]

One training step's drafter forward + backward (loss: mean square of the drafter's
output; the target's lm_head costs the same on both paths and is left out) for a
hidden-256 target at the default geometry (2 heads x 128, 2 KV heads, 5 layers
[sliding x4, full], window 2048), T tokens, N anchors x 16. This 2-core machine is
shared: the two paths alternate, each keeps its best of R rounds, and the figure is
their ratio. One torch thread by default: with other jobs on the cores, two OpenMP
threads stall on each other and the times swing several-fold. Appends a section to
benchmarks/RESULTS.md and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Timer, add_smoke_flag, append_results

HIDDEN, VOCAB, BLOCK = 256, 2048, 16
SIZES = [(384, 64), (384, 256), (1024, 64), (1024, 512)]
QUICK_SIZES = [(384, 64), (384, 256)]
SMOKE_SIZES = [(64, 4)]  # one round


def build_drafter():
    from store_schema.runtime.target_config import TargetConfig
    from train.families.dflash.model import DFlashDrafter, DrafterConfig

    target = TargetConfig(
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        intermediate_size=3 * HIDDEN,
        tie_word_embeddings=False,
    )
    config = DrafterConfig.from_target(target, mask_token_id=3, context_layer_ids=[1, 3, 5], architecture="dflash")
    torch.manual_seed(0)
    return DFlashDrafter(config), torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)


def step(drafter, embed, features, input_ids, anchors, attention: str) -> tuple[float, torch.Tensor]:
    drafter.zero_grad(set_to_none=True)
    with Timer() as t:
        out = drafter(features, input_ids, anchors, embed, attention=attention)
        out.square().mean().backward()
    return t.seconds, out.detach()


def measure(drafter, embed, length: int, anchors: int, rounds: int) -> dict:
    generator = torch.Generator().manual_seed(length + anchors)
    features = torch.randn(length, drafter.config.num_context_layers * HIDDEN, generator=generator)
    input_ids = torch.randint(0, VOCAB, (length,), generator=generator)
    positions = torch.randperm(length - BLOCK + 1, generator=generator)[:anchors].sort().values
    best = {"sdpa": float("inf"), "split": float("inf")}
    outputs = {}
    for _ in range(rounds):
        for attention in best:
            seconds, outputs[attention] = step(drafter, embed, features, input_ids, positions, attention)
            best[attention] = min(best[attention], seconds)
    return {
        "tokens": length,
        "anchors": anchors,
        "sdpa_s": round(best["sdpa"], 3),
        "split_s": round(best["split"], 3),
        "speedup": round(best["sdpa"] / best["split"], 2),
        "max_abs_diff": float((outputs["sdpa"] - outputs["split"]).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_SIZES}")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per size; each path keeps its best")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
    torch.set_num_threads(args.threads)
    drafter, embed = build_drafter()
    results = []
    for length, anchors in SMOKE_SIZES if args.smoke else QUICK_SIZES if args.quick else SIZES:
        results.append(measure(drafter, embed, length, anchors, args.rounds))
        print(results[-1], file=sys.stderr, flush=True)
    figures = {
        "attention_speedup_min": min(r["speedup"] for r in results),
        "attention_speedup_max": max(r["speedup"] for r in results),
        "sizes": results,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "quick": args.quick,
        "smoke": args.smoke,
    }
    rows = [
        (
            f"split vs sdpa, T={r['tokens']}, {r['anchors']} anchors (fwd+bwd s)",
            "> 1",
            f"{r['speedup']}x ({r['sdpa_s']} / {r['split_s']} s; max abs diff {r['max_abs_diff']:.1e})",
        )
        for r in results
    ]
    append_results(
        f"attention_bench{' --quick' if args.quick else ''}: hidden {HIDDEN}, 5 layers", rows, figures, smoke=args.smoke
    )


if __name__ == "__main__":
    main()
