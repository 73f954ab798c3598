"""GPU check for sessions with a device: extraction and training at real sizes on
one GPU, in one short run (goal: under 8 minutes on an H200).

    python benchmarks/gpu_check.py [--smoke]     # --smoke: tiny sizes, runs on CPU too

1. builds a ~2B Qwen3.5-architecture model from a config (random weights, bf16,
   vocabulary 248,320, no download) and saves it with the embedded tokenizer;
2. extracts a corpus into a store in-process with the project's own worker
   (`extract.worker.ExtractionWorker`, what each Ray actor runs), timing the
   forward passes alone and then the full extraction (forward + host copies +
   compression + checksums + fsync + commit): extraction tokens/s against
   forward-only tokens/s, and store write GB/s;
3. trains the drafter for a few steps with the streaming loader at the real
   vocabulary and 512 anchors: step time and loader wait.

Ray itself is not used (its wheel is larger than what travels to the device);
the worker is the same code. Prints one JSON line last."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import embedded  # noqa: E402

FULL = dict(hidden=2048, layers=24, heads=16, head_dim=128, vocab=248_320, records=4000, max_length=3072,
            train_steps=20, num_anchors=512, drafter_layers=5)
SMOKE = dict(hidden=64, layers=8, heads=4, head_dim=16, vocab=4096, records=40, max_length=512,
             train_steps=3, num_anchors=32, drafter_layers=1)


def build_target(path: Path, size: dict, device: str) -> None:
    from transformers import Qwen3_5ForCausalLM

    records = embedded.coding_chats(64)
    texts = [m["content"] for r in records for m in r["messages"]]
    embedded.build_tokenizer(path, texts, vocab_size=2048)
    config = embedded.qwen3_5_config(size["vocab"], size["hidden"], size["layers"], size["heads"], size["head_dim"])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    del model


def extract(model: Path, corpus: Path, store: Path, size: dict, device: str) -> dict:
    from extract.layers import resolve_layer_ids
    from extract.planning import build_plan
    from extract.worker import ExtractionSpec, ExtractionWorker, ShardFailed
    from store_schema import Fingerprint, Store, TargetFacts, create_store, on_disk_bytes, target_identity
    from store_schema.plan import PlanSettings

    plan = build_plan(str(corpus), str(model), PlanSettings(max_length=size["max_length"], shard_tokens=65536),
                      workers=4)
    layer_ids = resolve_layer_ids(str(model), None, 5)
    worker = ExtractionWorker(ExtractionSpec(model=str(model), tokenizer=str(model), corpus=str(corpus),
                                             store=str(store), layer_ids=tuple(layer_ids), settings=plan.settings,
                                             device=device, batch_tokens=65536))
    info = worker.info()
    facts = TargetFacts(num_target_layers=info.num_layers, hidden_size=info.hidden_size, vocab_size=info.vocab_size,
                        kernels=info.kernels)
    fingerprint = Fingerprint.for_extraction(target_identity(model), plan, layer_ids, facts)
    writer = create_store(store, fingerprint)
    writer.write_plan(plan)
    names = [s.name for s in plan.shards]
    worker.forward_only(names[:1])  # warm-up: first-call allocations and kernel selection
    forward = worker.forward_only(names)
    started = time.perf_counter()
    for name in names:
        result = worker.extract_shard(name)
        if isinstance(result, ShardFailed):
            raise RuntimeError(result)
    seconds = time.perf_counter() - started
    tokens = Store(store).num_tokens()
    raw = tokens * len(layer_ids) * size["hidden"] * 2
    return {
        "tokens": tokens,
        "layers": layer_ids,
        "forward_only_tokens_per_s": round(forward.tokens / forward.seconds),
        "extract_tokens_per_s": round(tokens / seconds),
        "extract_over_forward": round(seconds / forward.seconds, 3),
        "store_write_gb_s": round(raw / seconds / 1e9, 3),
        "store_bytes_ratio": round(on_disk_bytes(store) / raw, 4),
        "kernels": info.kernels,
    }


def train(model: Path, store: Path, out: Path, size: dict) -> dict:
    from train.config import load_config
    from train.fitting.trainer import Trainer

    config = load_config(None, {
        "model.num_hidden_layers": size["drafter_layers"], "model.num_anchors": size["num_anchors"],
        "data.max_length": size["max_length"], "train.log_every": 1, "eval.every": 10**9,
        "train.checkpoint_every": 10**9,
    }, store=str(store), target=str(model), out=str(out), **{"train.max_steps": size["train_steps"]})
    trainer = Trainer.from_config(config)
    trainer.fit()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r][1:]  # the first step includes compilation and warm-up
    return {
        "train_tokens_per_s": round(sum(r["tokens_per_s"] for r in steps) / max(1, len(steps))),
        "train_loader_wait_frac": round(sum(r["loader_wait_frac"] for r in steps) / max(1, len(steps)), 4),
        "train_peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU is fine)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    size = SMOKE if args.smoke else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=args.workdir))
    figures = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "smoke": args.smoke}
    try:
        started = time.perf_counter()
        build_target(work / "target", size, device)
        figures["build_s"] = round(time.perf_counter() - started, 1)
        corpus = embedded.write_jsonl(work / "corpus.jsonl", embedded.coding_chats(size["records"]))
        figures.update(extract(work / "target", corpus, work / "store", size, device))
        figures.update(train(work / "target", work / "store", work / "run", size))
        figures["wall_s"] = round(time.perf_counter() - started, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
