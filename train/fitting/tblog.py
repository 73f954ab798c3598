"""TensorBoard event files beside the JSONL log (`log.tensorboard=true`): every
number of a logged line becomes a scalar at that line's step under RUN/tb/, a
list of numbers (per-position accuracy) one scalar per slot (`key/slot`).
`train_log.jsonl` stays the record `diagnose` reads; these files are for looking."""

from __future__ import annotations

from pathlib import Path

from train.config_error import ConfigError

TB_DIR = "tb"


class TensorBoardLog:
    def __init__(self, run_dir: Path, start_step: int = 0):
        try:  # tensorboard is an optional dependency (the `tensorboard` extra)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "config log.tensorboard=true needs the tensorboard package: pip install 'dflash-cache[tensorboard]'"
            ) from None
        # purge_step: a resumed run's events after its checkpoint (step > start_step) are dropped,
        # as its JSONL lines are.
        self.writer = SummaryWriter(str(Path(run_dir) / TB_DIR), purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key == "step":
                continue
            if _number(value):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, list):
                for slot, item in enumerate(value, start=1):
                    if _number(item):
                        self.writer.add_scalar(f"{key}/{slot}", item, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
