"""fp8 parity: the same drafter trained on a bf16 and an fp8 store of the same corpus
(same target, plan, seed and steps), evaluated on the same held-out split.

    python benchmarks/fp8_parity.py [--quick] [--target DIR]

Everything runs through the project's command line, as a user would: `extract run`
twice (`--store-dtype bfloat16` / `fp8_e4m3`), `train fit`, `train export` and
`train eval --json` on each store. The target is a small dense Qwen3 pretrained
on the demo's coding corpus (built once, cached under the work dir; `--target`
takes another, e.g. the demo's `demo_out/cache/target-*`). The corpus asks for
each standard-library function three ways, so held-out samples share content with
trained ones and a small drafter's tau rises above 1 in minutes on CPU.

Prints one JSON line last: tau_bf16, tau_fp8, tau_ratio (goal >= 0.97), each
store's ratio to raw bf16 and the eval details."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
import embedded  # noqa: E402
from benchmarks.common import append_results  # noqa: E402
from demo import run  # noqa: E402  the demo's runner: a project command, its output streamed, its last JSON line

TARGET = dict(architecture="qwen3", vocab_size=1024, hidden_size=128, num_layers=6, num_heads=4, head_dim=32,
              pretrain_seq=128, pretrain_batch=8, lr=3e-3, seed=0)
DRAFTER = ["model.num_layers=2", "model.num_anchors=64", "data.max_length=512", "data.heldout_fraction=0.05",
           "optim.lr=2e-3", "train.log_every=50", "eval.every=0", "train.checkpoint_every=100000", "train.seed=0"]
SIZES = {  # (functions asked for, target pretraining steps, drafter steps)
    "quick": (150, 150, 300),
    "full": (600, 400, 1500),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus and fewer steps (~10 CPU minutes)")
    parser.add_argument("--target", help="target model directory (default: build the small pretrained Qwen3)")
    parser.add_argument("--workdir", default=str(REPO / "fp8_parity_out"), help="where stores and runs go")
    args = parser.parse_args()
    functions_count, pretrain_steps, train_steps = SIZES["quick" if args.quick else "full"]
    work = Path(args.workdir)
    started = time.time()

    functions = embedded.coding_chats(functions_count)
    records = embedded.coding_chats(functions_count, phrasings=3)
    corpus = embedded.write_jsonl(work / "corpus.jsonl", records)
    target = args.target or embedded.ensure_demo_target(work / "cache", functions, pretrain_steps=pretrain_steps, **TARGET)

    results = {}
    for dtype in ("bfloat16", "fp8_e4m3"):
        store, run_dir, drafter = work / f"store-{dtype}", work / f"run-{dtype}", work / f"drafter-{dtype}"
        for stale in (run_dir, drafter):
            shutil.rmtree(stale, ignore_errors=True)
        report = run(["-m", "extract", "run", "--model", target, "--corpus", corpus, "--store", store,
                      "--store-dtype", dtype, "--workers", "2", "--device", "cpu", "--num-context-layers", "2",
                      "--max-length", "512", "--shard-tokens", "16384", "--overwrite", "--no-progress"])
        info = run(["-m", "store_schema", "info", store, "--json"])
        overrides = [x for setting in DRAFTER for x in ("--set", setting)]
        run(["-m", "train", "fit", "--store", store, "--target", target, "--out", run_dir,
             "--max-steps", train_steps, *overrides], capture_json=False)
        run(["-m", "train", "export", run_dir, "--out", drafter])
        evaluation = run(["-m", "train", "eval", "--store", store, "--drafter", drafter, "--target", target,
                          "--ddtree-budgets", "8", "--max-blocks-per-sample", "64", "--json"])
        results[dtype] = {"tau": evaluation["tau"], "top1_acc": evaluation.get("top1_acc"),
                          "samples": evaluation["samples"], "ratio": info["ratio"], "disk_bytes": info["disk_bytes"],
                          "extract_tokens_per_s": report.get("tokens_per_s")}

    bf16, fp8 = results["bfloat16"], results["fp8_e4m3"]
    figures = {
        "tau_bf16": bf16["tau"],
        "tau_fp8": fp8["tau"],
        "tau_ratio": round(fp8["tau"] / bf16["tau"], 4),
        "bytes_ratio": bf16["ratio"],
        "fp8_bytes_ratio": fp8["ratio"],
        "top1_acc_bf16": bf16["top1_acc"],
        "top1_acc_fp8": fp8["top1_acc"],
        "heldout_samples": bf16["samples"],
        "train_steps": train_steps,
        "records": len(records),
        "target": str(target),
        "wall_s": round(time.time() - started, 1),
    }
    rows = [
        ("tau_ratio (fp8 / bf16, held-out, same seed and steps)", ">= 0.97", str(figures["tau_ratio"])),
        ("tau_bf16 / tau_fp8", "-", f"{figures['tau_bf16']} / {figures['tau_fp8']}"),
        ("store ratio to raw bf16: bf16 / fp8", "<= 0.70 / <= 0.40", f"{figures['bytes_ratio']} / {figures['fp8_bytes_ratio']}"),
    ]
    append_results(f"fp8_parity{' --quick' if args.quick else ''}: {len(records)} records, {train_steps} steps, "
                   f"{figures['heldout_samples']} held-out samples", rows, figures)


if __name__ == "__main__":
    main()
