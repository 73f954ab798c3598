"""What one optimizer step of a DFlash 2 selector codebook costs: dense AdamW on
a [V, r] fp32 parameter against SparseAdam on `nn.Embedding(sparse=True)`.

A training step touches only the rows of the predecessor ids and the top-K
candidates (rows x (1 + K) ids, at most that many distinct rows), so a sparse
update could skip the rest; a dense AdamW reads and writes every row's weight,
gradient and two moments each step. This script times one codebook's backward
and optimizer step both ways, with the ids of one sequence's scored rows
(512 anchors x 15 slots at the real job) drawn uniformly from the vocabulary
(the most distinct rows, the worst case for the sparse update), and reports the
optimizer state. Figures go to benchmarks/RESULTS.md; one JSON line last.

`--selector-memory` instead measures the peak extra memory of the chunked loss's
forward + backward with and without the selector term (each in a fresh process):
the selector must add K x r per scored row, never a [rows, V] tensor.

    python benchmarks/codebook_optim_bench.py            # V = 248,320, r = 256
    python benchmarks/codebook_optim_bench.py --selector-memory
    python benchmarks/codebook_optim_bench.py --quick    # tiny sizes, seconds (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_results
from train.families.dflash.config import LossConfig
from train.families.dflash.loss import dflash_loss
from train.families.dflash.targets import block_targets

METHODS = ("adamw_foreach", "adamw_fused", "sparse_adam")


def optimizer_for(method: str, params):
    if method == "adamw_foreach":
        return torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0, foreach=True)
    if method == "adamw_fused":
        return torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0, fused=True)
    if method == "sparse_adam":
        return torch.optim.SparseAdam(params, lr=6e-4)
    raise ValueError(f"unknown method {method!r} (known: {METHODS})")


def state_bytes(optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


def measure(method: str, vocab: int, rank: int, rows: int, top_k: int, steps: int, seed: int = 0) -> dict:
    """Median seconds of one backward and one optimizer step of a [vocab, rank] codebook
    looked up at rows x (1 + top_k) uniform ids, and the optimizer's state bytes."""
    generator = torch.Generator().manual_seed(seed)
    codebook = nn.Embedding(vocab, rank, sparse=method == "sparse_adam")
    optimizer = optimizer_for(method, codebook.parameters())
    backward, step, touched = [], [], []
    for _ in range(steps + 1):  # the first step allocates the moments: not timed
        ids = torch.randint(0, vocab, (rows * (1 + top_k),), generator=generator)
        coefficients = torch.randn(ids.shape[0], rank, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = (codebook(ids) * coefficients).sum()
        start = time.perf_counter()
        loss.backward()
        middle = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        backward.append(middle - start)
        step.append(end - middle)
        touched.append(int(ids.unique().numel()))
    return {
        "method": method,
        "vocab": vocab,
        "rank": rank,
        "ids_per_step": rows * (1 + top_k),
        "distinct_rows": int(statistics.median(touched[1:])),
        "backward_s": statistics.median(backward[1:]),
        "step_s": statistics.median(step[1:]),
        "state_bytes": state_bytes(optimizer),
    }


class PairSelector(nn.Module):
    """The reference CandidateSelector's bilinear term, for the memory measurement."""

    def __init__(self, vocab: int, hidden: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def pair_scores(self, hidden, predecessor_ids, candidate_ids):
        context = self.predecessor_codebook(predecessor_ids) * self.hidden_projection(hidden)
        return torch.einsum("nr,nkr->nk", context, self.successor_codebook(candidate_ids))


def loss_peak_child(variant: str, vocab: int, rank: int, anchors: int, top_k: int, chunk_rows: int) -> dict:
    """Peak extra RSS of one chunked loss forward + backward (hidden 256, block 16)."""
    torch.manual_seed(0)
    length, block, hidden_size = 3072, 16, 256
    input_ids = torch.randint(0, vocab, (length,))
    positions = torch.randperm(length - block)[:anchors].sort().values
    targets = block_targets(input_ids, torch.ones(length), positions, block, LossConfig(position_weights="decay"))
    hidden = torch.randn(anchors, block, hidden_size, requires_grad=True)
    head = torch.randn(vocab, hidden_size) * 0.02
    selector = PairSelector(vocab, hidden_size, rank) if variant == "selector" else None
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    out = dflash_loss(hidden, head, targets, chunk_rows=chunk_rows, selector=selector, selector_top_k=top_k)
    out.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"variant": variant, "rows": int(targets.valid.sum()), "peak_bytes": int(peak)}


def loss_peaks(args) -> list[dict]:
    results = []
    for variant in ("plain", "selector"):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--loss-child",
                variant,
                "--vocab",
                str(args.vocab),
                "--rank",
                str(args.rank),
                "--anchors",
                str(args.anchors),
                "--top-k",
                str(args.top_k),
                "--chunk-rows",
                str(args.chunk_rows),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    return results


def selector_memory(args) -> int:
    plain, with_selector = loss_peaks(args)
    rows = plain["rows"]
    summary = {
        "rows": rows,
        "plain_peak_bytes": plain["peak_bytes"],
        "selector_peak_bytes": with_selector["peak_bytes"],
        "rows_x_vocab_fp32_bytes": rows * args.vocab * 4,
    }
    mib = 2**20
    table = [
        (
            f"loss fwd + bwd peak extra RSS, V {args.vocab}, {rows} rows, chunk {args.chunk_rows}: plain / "
            f"+ selector (K {args.top_k}, r {args.rank})",
            "selector adds ~ rows x K x r, not rows x V",
            f"{plain['peak_bytes'] / mib:.0f} / {with_selector['peak_bytes'] / mib:.0f} MiB "
            f"(one [rows, V] fp32 tensor: {rows * args.vocab * 4 / mib:.0f} MiB)",
        )
    ]
    append_results("DFlash 2 selector loss memory (codebook_optim_bench --selector-memory)", table, summary)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512 * 15, help="scored rows of one sequence")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--quick", "--smoke", dest="quick", action="store_true", help="tiny sizes: a smoke run, nothing appended"
    )
    parser.add_argument("--selector-memory", action="store_true", help="the loss's peak memory with / without selector")
    parser.add_argument(
        "--anchors", type=int, default=128, help="--selector-memory: anchors of the 3072-token sequence"
    )
    parser.add_argument("--chunk-rows", type=int, default=256, help="--selector-memory: the loss's chunk_rows")
    parser.add_argument("--loss-child", choices=("plain", "selector"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loss_child:
        print(
            json.dumps(
                loss_peak_child(args.loss_child, args.vocab, args.rank, args.anchors, args.top_k, args.chunk_rows)
            )
        )
        return 0
    if args.selector_memory:
        return selector_memory(args)
    if args.quick:
        args.vocab, args.rank, args.rows, args.top_k, args.steps = 512, 8, 16, 4, 2
    results = [measure(m, args.vocab, args.rank, args.rows, args.top_k, args.steps) for m in METHODS]
    for result in results:
        print(json.dumps(result))
    by_method = {r["method"]: r for r in results}
    summary = {f"{m}_{key}": by_method[m][key] for m in METHODS for key in ("backward_s", "step_s", "state_bytes")}
    summary["distinct_rows"] = results[0]["distinct_rows"]
    if args.quick:  # the memory measurement's path too, in-process (its figure needs fresh processes)
        summary["quick_loss_rows"] = loss_peak_child("selector", args.vocab, args.rank, 4, args.top_k, 8)["rows"]
        print(json.dumps(summary))
        return 0
    rows = [
        (
            f"{m}: backward + step s / codebook [{args.vocab}, {args.rank}]",
            "-",
            f"{by_method[m]['backward_s']:.3f} + {by_method[m]['step_s']:.3f}; state "
            f"{by_method[m]['state_bytes'] / 2**20:.0f} MiB",
        )
        for m in METHODS
    ]
    rows.append(
        (
            "ids per step / distinct rows touched",
            "-",
            f"{results[0]['ids_per_step']} / {results[0]['distinct_rows']} (uniform ids)",
        )
    )
    append_results("DFlash 2 codebook optimizer step (codebook_optim_bench)", rows, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
