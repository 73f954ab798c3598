"""The optimizer with its schedule: AdamW over the drafter's fp32 master weights,
the LR of each step from `train.fitting.schedule.lr_at`, gradients clipped.

Its checkpoint state (`state_dict`) names parameters instead of numbering them, so
a checkpoint of a differently ordered model is refused rather than misloaded. The
schedule keeps no state of its own: the LR is a function of (step, total steps),
and a resumed run may be given more steps."""

from __future__ import annotations

import torch

from train.fitting.config import OptimConfig
from train.fitting.schedule import lr_at


def adamw_implementation(device_type: str) -> dict:
    """On CUDA the fused kernel: every parameter's update in one pass (a per-parameter
    AdamW reads and writes the 1.92 B-parameter DFlash 2's weights, gradients and two
    moments once per tensor, ~138 GB of HBM traffic a step). Elsewhere the per-parameter
    loop the CPU suite's exact-resume checks were measured with."""
    return {"fused": True} if device_type == "cuda" else {"foreach": False}


class Optimizer:
    """AdamW with weight decay on matrices only (not norms), stepped by the schedule
    of a `total_steps` run."""

    def __init__(self, drafter: torch.nn.Module, config: OptimConfig, total_steps: int):
        self.config, self.total_steps = config, total_steps
        self.names = [name for name, _ in drafter.named_parameters()]
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        device_type = self.params[0].device.type if self.params else "cpu"
        self.adamw = torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            eps=config.eps,
            **adamw_implementation(device_type),
        )

    def lr(self, step: int) -> float:
        """The LR of optimizer step `step` (0-based)."""
        return lr_at(step, self.total_steps, self.config)

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def clip(self, divisor: torch.Tensor | float = 1.0) -> torch.Tensor:
        """Divide the summed gradients by `divisor` (the step's normaliser) and clip their
        global norm to `optim.grad_clip` (0: no clipping) in one multiply, with nothing
        read back to the host; returns the norm before clipping (0-dim, on the device)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) / divisor
        clip = self.config.grad_clip
        coefficient = (clip / (norm + 1e-6)).clamp(max=1.0) if clip else 1.0  # as clip_grad_norm_'s
        torch._foreach_mul_(grads, coefficient / divisor)  # one launch per device and dtype, not one per parameter
        return norm

    def step(self, step: int) -> float:
        """Apply optimizer step `step` (0-based) at its LR; returns the LR."""
        lr = self.lr(step)
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        return lr

    def state_dict(self) -> dict:
        """AdamW's state: tensors keyed "<param name>/<key>", scalars and param groups by name."""
        state = self.adamw.state_dict()
        names, out, scalars = self.names, {}, {}
        for index, values in state["state"].items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    out[f"{names[index]}/{key}"] = value
                else:
                    scalars[f"{names[index]}/{key}"] = value
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
            for g in state["param_groups"]
        ]
        return {**out, "param_groups": groups, "scalars": scalars}

    def load_state_dict(self, state: dict) -> None:
        index = {name: i for i, name in enumerate(self.names)}
        groups = []
        for group in state["param_groups"]:
            unknown = [n for n in group["params"] if n not in index]
            if unknown:
                raise KeyError(f"optimizer checkpoint names parameters the model does not have: {unknown[:4]}")
            groups.append({**group, "params": [index[n] for n in group["params"]]})
        per_param: dict = {}
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        for key, value in [*tensors.items(), *state["scalars"].items()]:
            name, field = key.rsplit("/", 1)
            per_param.setdefault(index[name], {})[field] = value
        self.adamw.load_state_dict({"state": per_param, "param_groups": groups})
