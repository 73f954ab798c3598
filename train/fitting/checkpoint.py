"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

    RUN/checkpoints/step-00000100/
        model.safetensors      drafter weights (fp32 master copy), z-lab names
        optimizer.safetensors  AdamW moments and step counts, keyed "<param name>/<key>"
        rng.safetensors        torch CPU (+ CUDA) RNG, the run's anchor/noise generator
                               (lane 0's), each further lane's (`generator_lane_<j>`),
                               numpy's MT19937 key
        state.json             step, scheduler, loader position, drafter config,
                               optimizer param groups, python/numpy RNG scalars

A checkpoint is written into a temporary directory and renamed into place, so a
crash never leaves a half-written one where `latest_checkpoint` looks. Nothing
is ever unpickled: loading reads safetensors and JSON only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from train.tensor_files import read_tensors, save_tensors

CHECKPOINTS = "checkpoints"
LANE_GENERATOR = "generator_lane_"
PREFIX = "step-"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


# -- optimizer ---------------------------------------------------------------------------
def optimizer_state(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """(tensors, json) for `optimizer.state_dict()`; params are named, not numbered,
    so a checkpoint from a differently ordered model is refused rather than misloaded."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{names[index]}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{names[index]}/{key}"] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for group in meta["param_groups"]:
        unknown = [n for n in group["params"] if n not in index]
        if unknown:
            raise KeyError(f"optimizer checkpoint names parameters the model does not have: {unknown[:4]}")
        groups.append({**group, "params": [index[n] for n in group["params"]]})
    state: dict = {}
    for key, tensor in tensors.items():
        name, field = key.rsplit("/", 1)
        state.setdefault(index[name], {})[field] = tensor
    for key, value in meta["scalars"].items():
        name, field = key.rsplit("/", 1)
        state.setdefault(index[name], {})[field] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- RNG ---------------------------------------------------------------------------------
def rng_state(generator: torch.Generator) -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state(), "generator": generator.get_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, key, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_key"] = torch.from_numpy(np.asarray(key, dtype=np.uint32).view(np.int32).copy())
    version, internal, gauss = random.getstate()
    meta = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "generator_device": str(generator.device),
    }
    return tensors, meta


def restore_rng(tensors: dict, meta: dict, generator: torch.Generator) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    generator.set_state(tensors["generator"])
    cuda = [tensors[k] for k in sorted(t for t in tensors if t.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    n = meta["numpy"]
    key = tensors["numpy_key"].numpy().view(np.uint32)
    np.random.set_state((n["kind"], key, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    p = meta["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


# -- whole checkpoints -------------------------------------------------------------------
def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    state: dict,
    keep: int = 0,
    lane_generators: dict[int, torch.Tensor] | None = None,
) -> Path:
    """Write checkpoint `step` atomically; `state` is JSON (scheduler, loader, config...).
    keep > 0 deletes all but the newest `keep` checkpoints afterwards.
    lane_generators: the generator states of lanes 1.. of a run dealt into lanes
    (lane 0's is `generator`)."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    names = [name for name, _ in model.named_parameters()]
    weights = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    save_tensors(weights, tmp / "model.safetensors")
    opt_tensors, opt_meta = optimizer_state(optimizer, names)
    save_tensors(opt_tensors, tmp / "optimizer.safetensors")
    rng_tensors, rng_meta = rng_state(generator)
    rng_tensors.update({f"{LANE_GENERATOR}{lane}": t for lane, t in (lane_generators or {}).items() if lane != 0})
    save_tensors(rng_tensors, tmp / "rng.safetensors")
    body = {**state, "step": step, "optimizer": opt_meta, "rng": rng_meta}
    (tmp / "state.json").write_text(json.dumps(body, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: str | Path) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def load_model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return read_tensors(Path(path) / "model.safetensors")


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, generator: torch.Generator | None
) -> dict:
    """Restore weights (strict), optimizer and every RNG; return state.json's dict."""
    path = Path(path)
    state = read_state(path)
    result = model.load_state_dict(load_model_weights(path), strict=True)
    del result
    if optimizer is not None:
        names = [name for name, _ in model.named_parameters()]
        load_optimizer_state(optimizer, names, read_tensors(path / "optimizer.safetensors"), state["optimizer"])
    if generator is not None:
        restore_rng(read_tensors(path / "rng.safetensors"), state["rng"], generator)
    return state


def load_lane_generators(path: str | Path) -> dict[int, torch.Tensor]:
    """Generator state of every lane a checkpoint holds (lane 0: the run's generator)."""
    tensors = read_tensors(Path(path) / "rng.safetensors")
    states = {int(k[len(LANE_GENERATOR):]): t for k, t in tensors.items() if k.startswith(LANE_GENERATOR)}
    return {0: tensors["generator"], **states}
