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

    python benchmarks/codebook_optim_bench.py            # V = 248,320, r = 256
    python benchmarks/codebook_optim_bench.py --quick    # tiny sizes, seconds (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_results  # noqa: E402

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
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512 * 15, help="scored rows of one sequence")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, nothing appended")
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.rank, args.rows, args.top_k, args.steps = 512, 8, 16, 4, 2
    results = [measure(m, args.vocab, args.rank, args.rows, args.top_k, args.steps) for m in METHODS]
    for result in results:
        print(json.dumps(result))
    by_method = {r["method"]: r for r in results}
    summary = {f"{m}_{key}": by_method[m][key] for m in METHODS for key in ("backward_s", "step_s", "state_bytes")}
    summary["distinct_rows"] = results[0]["distinct_rows"]
    if args.quick:
        print(json.dumps(summary))
        return 0
    rows = [
        (f"{m}: backward + step s / codebook [{args.vocab}, {args.rank}]", "-",
         f"{by_method[m]['backward_s']:.3f} + {by_method[m]['step_s']:.3f}; state "
         f"{by_method[m]['state_bytes'] / 2**20:.0f} MiB") for m in METHODS
    ]
    rows.append(("ids per step / distinct rows touched", "-",
                 f"{results[0]['ids_per_step']} / {results[0]['distinct_rows']} (uniform ids)"))
    append_results("DFlash 2 codebook optimizer step (codebook_optim_bench)", rows, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
