"""`verify --recompute N --model PATH`: re-run the target on N committed samples
with plain transformers (`output_hidden_states`, independent of the extraction
code's hooks) and compare every stored layer per token by cosine similarity.

This is how a store made with the PyTorch fallback is checked against the fast
kernels, or a store against the checkpoint it claims to come from.

The bar is a per-token cosine of 0.999 for bf16 stores. fp8 stores hold each value
to within 2^-4 of itself (e4m3 rounding): measured on real activations the
dequantized states' worst token cosine against bf16 is ~0.9995, so their bar is
0.995 (a projected store is compared with the fresh states on its kept directions:
what it promises to hold); fp4 stores (e2m1 with a scale per 32 values, about 12 % relative error) measured
a worst token cosine of 0.988 and a mean of 0.993 on two real stores, so theirs is 0.98:
both still far above what another checkpoint or layer gives (< 0.9). A worst cosine
below OTHER_TARGET_COSINE is not numerics: the report asks first whether `--model` is
the checkpoint the store was extracted from (and names what its fingerprint recorded)."""

from __future__ import annotations

import random

import torch

from .. import layout
from ..projection import lift, project
from ..reader import StoreReader
from ..runtime.target_model import load_target_model

MIN_COSINE = {"bfloat16": 0.999, "fp8_e4m3": 0.995, "fp4_e2m1": 0.98}  # per store dtype, see above
OTHER_TARGET_COSINE = 0.9  # below this, another checkpoint (or layer), not rounding


def recompute_check(
    store: StoreReader,
    model_path: str,
    num_samples: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    trust_remote_code: bool = False,
) -> tuple[list[dict], list[dict]]:
    """Returns (per-sample results, problems). A problem is any layer whose worst
    token cosine is below the store dtype's MIN_COSINE. The model is loaded whole
    (`store_schema.runtime.target_model`: bf16 on CUDA, fp32 elsewhere)."""
    locations = store.sample_locations()
    picks = random.Random(seed).sample(locations, min(num_samples, len(locations)))
    # the one loader: missing weights are refused here, not left random to surface as a low cosine
    loaded = load_target_model(model_path, device, trust_remote_code=trust_remote_code)
    model, device, num_layers = loaded.model, loaded.device, loaded.num_layers
    if num_layers != store.fingerprint.num_target_layers:
        return [], [
            {
                "shard": "",
                "array": "",
                "file": "",
                "what": f"model has {num_layers} layers, store was made from {store.fingerprint.num_target_layers}",
            }
        ]
    results, problems = [], []
    min_cosine = MIN_COSINE[store.fingerprint.dtype]
    lifts = store.lifts()
    for name, index in picks:
        sample = store.read_sample(name, index)
        ids = sample.input_ids.to(torch.long)[None].to(device)
        with torch.no_grad():
            states = model(input_ids=ids, output_hidden_states=True).hidden_states
        entry: dict = {"shard": name, "sample": sample.sample_id, "min_cosine": {}}
        for layer_id, stored in sample.hidden.items():
            fresh = states[layer_id + 1][0].float().cpu()
            if layer_id in lifts:  # a projected store holds the states on its kept directions
                fresh = lift(project(fresh, lifts[layer_id]), lifts[layer_id]).float()
            cosine = torch.nn.functional.cosine_similarity(fresh, stored.float(), dim=-1)
            worst = float(cosine.min())
            entry["min_cosine"][layer_id] = round(worst, 6)
            if not worst >= min_cosine:
                problems.append(
                    {
                        "shard": name,
                        "array": layout.layer_array(layer_id),
                        "file": "",
                        "what": f"sample {sample.sample_id!r}: recomputed cosine {worst:.5f} < {min_cosine} "
                        f"at token {int(cosine.argmin())}",
                    }
                )
        results.append(entry)
    worst = min((c for entry in results for c in entry["min_cosine"].values()), default=1.0)
    if worst < OTHER_TARGET_COSINE:
        problems.insert(0, other_target_question(store, model_path, worst, min_cosine))
    return results, problems


def other_target_question(store: StoreReader, model_path: str, worst: float, min_cosine: float) -> dict:
    """The problem a far-too-low cosine leads with: is `model_path` the store's target?"""
    differences = store.fingerprint.target_differences(model_path)
    known = f"; it differs from the store's target in {', '.join(differences)}" if differences else ""
    return {
        "shard": "",
        "array": "",
        "file": "",
        "what": f"worst recomputed cosine {worst:.3f}, far below {min_cosine}: is --model {model_path} the checkpoint "
        f"the store was extracted from ({store.fingerprint.target_model}){known}?",
    }
