"""`verify --recompute N --model PATH`: re-run the target on N committed samples
with plain transformers (`output_hidden_states`, independent of the extraction
code's hooks) and compare every stored layer per token by cosine similarity.

This is how a store made with the PyTorch fallback is checked against the fast
kernels, or a store against the checkpoint it claims to come from."""

from __future__ import annotations

import random

import torch

from . import layout
from .reader import Store

MIN_COSINE = 0.999


def recompute_check(store: Store, model_path: str, num_samples: int, device: str = "cpu", seed: int = 0,
                    trust_remote_code: bool = False) -> tuple[list[dict], list[dict]]:
    """Returns (per-sample results, problems). A problem is any layer whose worst
    token cosine is below MIN_COSINE."""
    from transformers import AutoModelForCausalLM

    locations = store.sample_locations()
    picks = random.Random(seed).sample(locations, min(num_samples, len(locations)))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    model.to(device).eval()
    num_layers = model.config.get_text_config().num_hidden_layers
    if num_layers != store.fingerprint.num_target_layers:
        return [], [{"shard": "", "array": "", "file": "", "what":
                     f"model has {num_layers} layers, store was made from {store.fingerprint.num_target_layers}"}]
    results, problems = [], []
    for name, index in picks:
        sample = store.read_sample(name, index)
        ids = sample.input_ids.to(torch.long)[None].to(device)
        with torch.no_grad():
            states = model(input_ids=ids, output_hidden_states=True).hidden_states
        entry = {"shard": name, "sample": sample.sample_id, "min_cosine": {}}
        for layer_id, stored in sample.hidden.items():
            fresh = states[layer_id + 1][0].float().cpu()
            cosine = torch.nn.functional.cosine_similarity(fresh, stored.float(), dim=-1)
            worst = float(cosine.min())
            entry["min_cosine"][layer_id] = round(worst, 6)
            if not worst >= MIN_COSINE:
                problems.append({
                    "shard": name, "array": layout.layer_array(layer_id), "file": "",
                    "what": f"sample {sample.sample_id!r}: recomputed cosine {worst:.5f} < {MIN_COSINE} "
                            f"at token {int(cosine.argmin())}",
                })
        results.append(entry)
    return results, problems
