"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

    RUN/checkpoints/step-00000100/
        model.safetensors      drafter weights (fp32 master copy), z-lab names
        optimizer.safetensors  AdamW moments and step counts, keyed "<param name>/<key>"
        rng.safetensors        torch CPU (+ CUDA) RNG, numpy's MT19937 key, and every
                               lane's anchor/noise generator (`generator`: lane 0's, the
                               run's; `generator_lane_<j>`: lane j's)
        projection.safetensors a projected store's directions (its runs only), folded at export
        state.json             step, the run's record (config, drafter config, store,
                               held-out split, run_info), each part's JSON (optimizer
                               param groups, loader positions, python/numpy RNG scalars)

The parts of a run own what they keep (torchtitan's Stateful pattern): each has a
`state_dict()` whose tensors go into its safetensors file and whose other values go
under its key of state.json, and a `load_state_dict()` that takes them back
(`PARTS` says where each lives). `Checkpointer` collects them, writes a checkpoint
into a temporary directory and renames it into place, so a crash never leaves a
half-written one where `latest` looks, and decides when one is due. Periodic
checkpoints are written in the background: the states are copied to host memory
(pinned, on CUDA) and a thread writes them while training goes on; a write that
fails stops the run at the next checkpoint or at the end, naming its step. A checkpoint
that does not fit (checked before writing, or the disk fills while writing) leaves
no partial directory and raises `CheckpointSpaceError`; the partial directory of a
process killed mid-save is removed when the run starts again. Nothing is
ever unpickled: loading reads safetensors and JSON only.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from store_schema.runtime import host
from store_schema.runtime.units import human_bytes
from train.tensor_files import CHECKPOINT_FIX, read_tensors, save_tensors

CHECKPOINTS = "checkpoints"
PREFIX = "step-"
PARTIAL = ".tmp"  # suffix of a checkpoint being written
STATE_FILE = "state.json"
MODEL_FILE = "model.safetensors"
# part -> (its key in state.json, its tensor file); the drafter's state is tensors only
PARTS = {
    "drafter": (None, MODEL_FILE),
    "optimizer": ("optimizer", "optimizer.safetensors"),
    "rng": ("rng", "rng.safetensors"),
    "feed": ("loader", "rng.safetensors"),
    "projection": ("projection", "projection.safetensors"),  # a projected store's (train.fitting.store_projection)
}


class CheckpointSpaceError(OSError):
    """A checkpoint that does not fit in the run directory: a disk-full OSError (so
    the one disk-full rule, `host.is_disk_full`, covers it) whose text is the whole
    message; nothing of the checkpoint was left."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror or ""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict:
    """A checkpoint's state.json: its step, the run's record and each part's JSON."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return read_tensors(Path(path) / MODEL_FILE, CHECKPOINT_FIX)


class Checkpointer:
    """Saves and restores a run's parts in RUN/checkpoints; `keep` > 0 deletes all
    but the newest `keep` after each save; `every` steps a checkpoint is due (0: only
    at the end)."""

    def __init__(self, run_dir: str | Path, every: int = 0, keep: int = 0):
        self.run_dir, self.every, self.keep = Path(run_dir), every, keep
        self.writing: threading.Thread | None = None  # a background save's writer
        self.write_error: BaseException | None = None
        self.host_copies: dict[str, torch.Tensor] = {}  # pinned buffers, reused save after save

    def resume_point(self, resume: bool) -> Path | None:
        """The checkpoint a run continues from (None: it starts afresh); refuses
        `--resume` without one and a fresh start over an earlier run's. Partial
        checkpoints a killed save left are removed first."""
        for partial in (self.run_dir / CHECKPOINTS).glob(f"{PREFIX}*{PARTIAL}"):
            shutil.rmtree(partial, ignore_errors=True)
        latest = latest_checkpoint(self.run_dir)
        if resume and latest is None:
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.run_dir / CHECKPOINTS} "
                "(nothing to continue; without --resume the run starts afresh)"
            )
        if not resume and latest is not None:
            raise FileExistsError(
                f"{self.run_dir} already holds checkpoints; pass --resume to continue it or use a new --out"
            )
        return latest

    def check_space(self, checkpoint_bytes: int, steps_left: int, override: str) -> None:
        """Refuse a run whose checkpoints cannot fit in the run directory's free
        space: at the peak, `keep` + 1 of them (the next is written before the oldest
        goes), or every one still to come when all are kept, less those already there."""
        coming = (steps_left // self.every if self.every else 0) + 1  # + the last step's
        existing = len(list_checkpoints(self.run_dir))
        count = min(coming, max(1, self.keep + 1 - existing)) if self.keep > 0 else coming
        needed, free = count * checkpoint_bytes, host.free_bytes(self.run_dir)
        if needed > free:
            raise CheckpointSpaceError(
                f"{self.run_dir}: the run's checkpoints need about {human_bytes(needed)} ({count} of "
                f"~{human_bytes(checkpoint_bytes)}: weights and AdamW moments), its filesystem has "
                f"{human_bytes(free)} free -- free space or choose another --out, or pass {override} to start anyway"
            )

    def due(self, step: int) -> bool:
        """A periodic checkpoint is due after step `step`."""
        return bool(self.every) and step % self.every == 0

    def latest(self) -> Path | None:
        return latest_checkpoint(self.run_dir)

    def save(self, step: int, parts: dict[str, Stateful], record: dict, background: bool = False) -> Path:
        """Write checkpoint `step` atomically: each part's state where `PARTS` puts
        it, and `record` (JSON) at the top of state.json. Refused before writing when
        the free space is short of it (`CheckpointSpaceError`). `background`: the
        states are copied to host memory now and written by a thread while training
        goes on; `wait` (and the next save) finishes it and raises what stopped it."""
        self.wait()
        files, body = self.collect(step, parts, record, self.host_copy if background else None)
        final = checkpoint_dir(self.run_dir, step)
        needed = sum(t.nbytes for tensors in files.values() for t in tensors.values())
        free = host.free_bytes(final.parent)  # through the module: tests fake the free space there
        if needed > free:
            raise CheckpointSpaceError(
                f"no space for the checkpoint of step {step} in {final.parent}: it takes "
                f"about {human_bytes(needed)}, {human_bytes(free)} free"
            )
        if not background:
            self.write(step, files, body, final)
            return final
        body = copy.deepcopy(body)  # its lists (e.g. the skipped shards) may grow while the thread writes
        self.writing = threading.Thread(
            target=self.write_or_keep_error, args=(step, files, body, final), name=f"checkpoint-{step}"
        )
        self.writing.start()
        return final

    def wait(self) -> None:
        """Finish the checkpoint a background save is writing; raise what stopped it."""
        if self.writing is None:
            return
        self.writing.join()
        self.writing = None
        error, self.write_error = self.write_error, None
        if error is not None:
            raise error

    def write_or_keep_error(self, step: int, files: dict, body: dict, final: Path) -> None:
        try:
            self.write(step, files, body, final)
        except BaseException as error:  # raised by `wait`, in the training thread
            self.write_error = error

    def write(self, step: int, files: dict, body: dict, final: Path) -> None:
        """Write into a temporary directory, rename it into place, drop the oldest beyond `keep`."""
        tmp = final.with_name(final.name + PARTIAL)
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir(parents=True)
            for file, tensors in files.items():
                save_tensors(tensors, tmp / file)
            (tmp / STATE_FILE).write_text(json.dumps(body, indent=1) + "\n")
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if host.is_disk_full(error):
                reason = getattr(error, "strerror", None) or error
                raise CheckpointSpaceError(
                    f"disk full writing the checkpoint of step {step} in {final.parent} ({reason})"
                ) from error
            raise
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        if self.keep > 0:
            for old in list_checkpoints(self.run_dir)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def host_copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` the next steps cannot change while a thread writes it: on
        CUDA into a pinned host buffer kept for the next save (the copy engine fills it
        at full speed), elsewhere a clone."""
        if tensor.device.type != "cuda":
            return tensor.detach().clone()
        buffer = self.host_copies.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.host_copies[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer.copy_(tensor.detach(), non_blocking=True)

    @staticmethod
    def collect(
        step: int, parts: dict[str, Stateful], record: dict, copy: Callable[[str, torch.Tensor], torch.Tensor] | None
    ) -> tuple[dict, dict]:
        """Each part's state split as `PARTS` says: {file: tensors}, and state.json's body.
        `copy(key, tensor)` takes each tensor to the host (None: `.cpu()`, which may share
        a CPU tensor's memory)."""
        files: dict[str, dict[str, torch.Tensor]] = {}
        body = {**record, "step": step}
        for name, part in parts.items():
            key, file = PARTS[name]
            state = part.state_dict()
            tensors = {
                k: (copy(f"{file}/{k}", v) if copy else v.detach().cpu()).contiguous()
                for k, v in state.items()
                if isinstance(v, torch.Tensor)
            }
            files.setdefault(file, {}).update(tensors)
            if key is not None:
                body[key] = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        if copy and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies are complete before the thread reads them
        return files, body

    @staticmethod
    def load(path: str | Path, parts: dict[str, Stateful]) -> dict:
        """Restore each part from checkpoint `path` (its whole tensor file and its
        JSON); return state.json's dict."""
        path = Path(path)
        body = read_state(path)
        files: dict[str, dict[str, torch.Tensor]] = {}
        for name, part in parts.items():
            key, file = PARTS[name]
            if file not in files:
                files[file] = read_tensors(path / file, CHECKPOINT_FIX)
            part.load_state_dict({**files[file], **(body[key] if key is not None else {})})
        return body
