"""The process-wide random generators a checkpoint keeps: torch's CPU (and CUDA)
generators, numpy's and Python's. A run draws its anchors and noise from its lanes'
own generators (`train.data.lanes`); these cover whatever else draws (dropout,
library code), so a resumed run continues exactly."""

from __future__ import annotations

import random

import numpy as np
import torch


class GlobalRNG:
    """A checkpoint part (`train.fitting.checkpoint.PARTS["rng"]`)."""

    def state_dict(self) -> dict:
        state: dict = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                state[f"torch_cuda_{i}"] = s
        kind, key, pos, has_gauss, cached = np.random.get_state()
        state["numpy_key"] = torch.from_numpy(np.asarray(key, dtype=np.uint32).view(np.int32).copy())
        version, internal, gauss = random.getstate()
        state["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        state["python"] = {"version": version, "internal": list(internal), "gauss": gauss}
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch_cpu"])
        cuda = [state[k] for k in sorted(k for k in state if k.startswith("torch_cuda_"))]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
        n = state["numpy"]
        key = state["numpy_key"].numpy().view(np.uint32)
        np.random.set_state((n["kind"], key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
        p = state["python"]
        random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
