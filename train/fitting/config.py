"""The run config's sections the fitting loop owns: `loss` (train.families.dflash.step and
loss), `optim` (train.fitting.optimizer and schedule), `train` (the loop's batch, length
and cadence) and `log` (train.fitting.run_writer); `train/config.py` composes them into
the run's."""

from __future__ import annotations

from dataclasses import dataclass

from train.config_error import ConfigError, require
from train.dtypes import dtype_name


@dataclass
class OptimConfig:
    lr: float = 6e-4
    warmup_fraction: float = 0.04  # of the total optimizer steps
    schedule: str = "cosine"  # "cosine" or "constant" (both after linear warmup)
    min_lr_ratio: float = 0.0  # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0  # SpecForge's DFlash optimizer (BF16Optimizer) uses 0
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's defaults, as SpecForge's DFlash training uses
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping

    def validate(self):
        require(self.lr > 0, "optim.lr", "must be > 0")
        require(0.0 <= self.warmup_fraction < 1.0, "optim.warmup_fraction", "must be in [0, 1)")
        require(self.schedule in ("cosine", "constant"), "optim.schedule", "must be cosine or constant")
        require(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "must be two values in [0, 1)"
        )
        require(self.eps > 0, "optim.eps", "must be > 0")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")


@dataclass
class TrainConfig:
    batch_size: int = 1  # sequences per micro-step (each is its own drafter forward)
    grad_accumulation: int = 8  # micro-steps per optimizer step: global batch batch_size x this = 8 sequences
    epochs: int = 6
    max_steps: int | None = None  # optimizer steps; None: as many as `epochs` give
    seed: int = 0
    # autocast dtype on CUDA: bfloat16 or float32 (not float16: no loss scaler); weights and optimizer stay fp32
    dtype: str = "bfloat16"
    device: str = "auto"  # "auto": cuda if available, else cpu
    log_every: int = 10
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2  # newest checkpoints kept (0: keep all)
    progress_interval: float = 30.0  # seconds between progress lines when stderr is not a terminal
    # DDP's gradient all-reduce: fp32, bf16 (half the bytes), or auto: bf16 between CUDA GPUs
    # without NVLink (`nvidia-smi topo -m`), else fp32
    grad_allreduce: str = "auto"

    def validate(self):
        require(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        require(self.grad_accumulation >= 1, "train.grad_accumulation", "must be >= 1")
        require(self.epochs >= 1, "train.epochs", "must be >= 1")
        require(self.max_steps is None or self.max_steps >= 1, "train.max_steps", "must be >= 1")
        try:
            self.dtype = dtype_name(self.dtype)
        except ValueError as error:
            raise ConfigError(f"config train.dtype: {error}") from None
        # fp16's 5-bit exponent underflows small gradients without a loss scaler, which this
        # trainer does not have: bf16 trains without one (same exponent range as fp32).
        require(
            self.dtype != "float16",
            "train.dtype",
            "float16 is refused: training in it needs a loss scaler; use bfloat16 (or float32)",
        )
        require(
            self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
            "train.device",
            "must be auto, cpu or cuda[:N]",
        )
        for name in ("log_every", "checkpoint_every", "keep_checkpoints"):
            require(getattr(self, name) >= 0, f"train.{name}", "must be >= 0")
        require(self.log_every >= 1, "train.log_every", "must be >= 1")
        require(self.grad_allreduce in ("auto", "fp32", "bf16"), "train.grad_allreduce", "must be auto, fp32 or bf16")
        require(self.progress_interval >= 0, "train.progress_interval", "must be >= 0 (seconds)")

    @property
    def sequences_per_step(self) -> int:
        """The global batch: sequences per optimizer step."""
        return self.batch_size * self.grad_accumulation


@dataclass
class LogConfig:
    tensorboard: bool = (
        False  # also write the logged metrics as TensorBoard events under RUN/tb/ (JSONL stays the record)
    )
    samples: bool = False  # each rank writes RUN/samples/rank-<r>.jsonl: every trained sample's step, lane, epoch, id

    def validate(self):
        return self
