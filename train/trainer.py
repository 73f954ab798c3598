"""The fit loop: stream the store, train the drafter, log, evaluate, checkpoint.

Order of a run (`Trainer.from_config`):
1. Read the target's config and its frozen `embed_tokens` / `lm_head` from its
   safetensors (the target model is never built).
2. Check the store against the target: hidden size, vocabulary and layer count
   must match (refused naming the field), and no context layer may be the
   target's final layer (its features produce the logits: a shortcut that does
   not exist at inference, bug 2 of the seeds).
3. Resolve the mask token (`train.mask_token`) and build the drafter from the
   store's layer ids, or, fine-tuning (`model.init_from`), from a published
   drafter's shape and weights once they fit (`train.init_from`); AdamW over
   fp32 master weights (bf16 autocast on CUDA), linear warmup then cosine, the
   streaming loader.
4. Every optimizer step: the global batch, `batch_size x grad_accumulation`
   sequences (8 by default), each its own `dflash_step` (anchors drawn from the
   loss mask, targets built from clean tokens before any noise, chunked loss
   through the frozen head); the loss normalised over all weighted labels of the
   step (`loss.normalize`), gradients clipped, stepped.
5. `train_log.jsonl` gets one line per logged step, evaluators run every
   `eval.every` steps (their `heldout_*` / `eval_*` keys go into the same log),
   and a checkpoint (safetensors + JSON) every `checkpoint_every` steps and at
   the end; the checkpoint records the run's held-out split.

Evaluation hook: `Trainer.evaluators` is a list of callables
`(trainer, step) -> dict`; their dicts are merged into the log line of that
step. The defaults are `train.evaluators.HeldoutEval` (held-out loss and
accuracies) and `AcceptanceEval` (tau, DDTree); more can be appended without
touching the loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from store_schema import Store, file_sha256
from store_schema.host import resolve_device
from store_schema.target_config import TargetConfig, read_target_config
from train import checkpoint as ckpt
from train.config import ConfigError, RunConfig
from train.dtypes import torch_dtype
from train.evaluators import AcceptanceEval, HeldoutEval
from train.heldout import heldout_record
from train.loader import LoaderPosition, ShardLoader, TrainSample
from train.loss import default_gamma
from train.export import load_weights
from train.init_from import fine_tune_config, init_record, read_source
from train.mask_token import resolve_mask_token
from train.metrics import MetricSums
from train.progress import TrainingInterrupted, fit_progress, headline, sigint_deferred
from train.model import DFlashDrafter, DrafterConfig
from train.runlog import LOG_FILE, append_log, truncate_log
from train.schedule import lr_at
from train.step import dflash_step
from train.target_head import TargetHead, load_target_head


# -- checks and components ---------------------------------------------------------------
def check_store_against_target(store: Store, target: TargetConfig) -> list[int]:
    """Refuse a store made from another target (FingerprintMismatch naming each
    differing field); return its layer ids. A store holding the target's final
    layer never gets here: its fingerprint is refused when the store is opened
    (`store_schema.layout.validate_layer_ids`)."""
    store.fingerprint.check(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=target.num_hidden_layers
    )
    return list(store.layer_ids)


def plan_drafter(config: RunConfig, target: TargetConfig, store_layer_ids: list[int], latest: Path | None,
                 log: Callable[[str], None]) -> tuple[DrafterConfig, dict]:
    """The drafter a run trains, and how the run started (`run_info`, kept in its
    checkpoints and exports). Sized for the target (published geometry, the
    store's layers) by default; with `model.init_from`, the shape of that drafter
    (`train.init_from`); resumed, it must equal the checkpoint's. The mask token
    is resolved here (`train.mask_token`), logged, and written into the config."""
    model = config.model
    checkpointed = DrafterConfig.from_dict(ckpt.read_state(latest)["drafter_config"]) if latest else None
    source = read_source(model.init_from) if model.init_from and checkpointed is None else None
    mask = resolve_mask_token(model.mask_token_id, config.target, target.vocab_size,
                              init_from_id=source.mask_token_id if source else None)
    log(f"fit: {mask.describe()}")
    model.mask_token_id = mask.id  # the saved run config records the id it trains with
    run_info: dict = {"mask_token_rule": mask.rule}
    if model.init_from:
        base, where = (source, f"--init-from {model.init_from}") if source else (checkpointed, f"--resume {latest}")
        drafter_config = fine_tune_config(base, where, model, target, store_layer_ids, mask.id)
    else:
        drafter_config = DrafterConfig.from_target(target, mask_token_id=mask.id, context_layer_ids=store_layer_ids,
                                                   **model.geometry())
    if checkpointed is not None:
        changed = drafter_config.differences(checkpointed)
        if changed:
            raise ConfigError(f"--resume: {latest} holds a different drafter: {'; '.join(changed)}")
    if source is not None:
        run_info["init_from"] = init_record(model.init_from)
        log(f"fit: fine-tuning from {run_info['init_from']['path']} (weights sha256 "
            f"{run_info['init_from']['model_sha256'][:12]})")
    return drafter_config, run_info


def build_optimizer(drafter: torch.nn.Module, optim) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms)."""
    decay = [p for p in drafter.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, foreach=False)


def pick_device(name: str) -> torch.device:
    return resolve_device(name, "config train.device")


# -- the trainer -------------------------------------------------------------------------
class Trainer:
    def __init__(
        self,
        config: RunConfig,
        head: TargetHead,
        drafter: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        loader: ShardLoader,
        total_steps: int,
        device: torch.device,
        generator: torch.Generator,
        start_step: int = 0,
        store_info: dict | None = None,
        log: Callable[[str], None] = print,
        run_info: dict | None = None,
    ):
        self.config = config
        self.head = head
        self.drafter = drafter
        self.optimizer = optimizer
        self.loader = loader
        self.total_steps = total_steps
        self.device = device
        self.generator = generator
        self.step = start_step
        self.store_info = store_info or {}
        self.run_info = run_info or {}  # how the run started (mask token rule, ...): checkpoints and exports keep it
        self.log = log
        self.run_dir = Path(config.out)
        self.evaluators: list[Callable[[Trainer, int], dict]] = [
            HeldoutEval(config.eval),
            AcceptanceEval(config.eval, attention=config.model.attention),
        ]
        self.position = loader.start
        self._last_eval_step: int | None = None
        self.epoch = loader.start.epoch
        autocast = device.type == "cuda" and config.train.dtype != "float32"
        self._autocast = (
            (lambda: torch.autocast("cuda", dtype=torch_dtype(config.train.dtype))) if autocast else nullcontext
        )

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: RunConfig, resume: bool = False, log: Callable[[str], None] = print) -> "Trainer":
        run_dir = Path(config.out)
        latest = ckpt.latest_checkpoint(run_dir) if resume else None
        if resume and latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / ckpt.CHECKPOINTS}")
        if not resume and ckpt.latest_checkpoint(run_dir) is not None:
            raise FileExistsError(f"{run_dir} already holds checkpoints; pass --resume to continue it or use a new --out")

        device = pick_device(config.train.device)
        target = read_target_config(config.target)
        store = Store(config.store)
        layer_ids = check_store_against_target(store, target)
        if config.loss.labels == "target" or config.loss.kl_mix > 0 or config.eval.labels == "target":
            if not store.fingerprint.target_topk:
                raise ConfigError(
                    "config loss.labels=target / loss.kl_mix > 0 / eval.labels=target need the target's top-k "
                    f"in the store; {store.path} was extracted without it"
                )
        if config.loss.gamma is None:
            default_gamma(config.model.block_size)  # refuse a block size without a default before any work
        expected_config = store.fingerprint.target_config_sha256
        if expected_config and expected_config != file_sha256(Path(config.target) / "config.json"):
            log(f"warning: {config.target}/config.json differs from the one the store was extracted with")

        drafter_config, run_info = plan_drafter(config, target, layer_ids, latest, log)
        layer_ids = drafter_config.context_layer_ids  # a fine-tuned drafter reads its own layers of the store
        head_dtype = torch_dtype(config.train.dtype) if device.type == "cuda" else torch.float32
        head = load_target_head(config.target, dtype=head_dtype, device=device)
        torch.manual_seed(config.train.seed)
        drafter = DFlashDrafter(drafter_config)
        if latest is None and config.model.init_from:
            load_weights(drafter, config.model.init_from)  # fine-tuning starts from the published weights
        drafter = drafter.to(device)  # fp32 master weights
        drafter.gradient_checkpointing = config.model.gradient_checkpointing
        optimizer = build_optimizer(drafter, config.optim)
        generator = torch.Generator().manual_seed(config.train.seed)

        start_step, position = 0, LoaderPosition()
        shards = None
        if latest is not None:
            state = ckpt.load_checkpoint(latest, drafter, optimizer, generator)
            start_step = state["step"]
            position = LoaderPosition.from_dict(state["loader"]["position"])
            shards = state["loader"]["shards"]
            run_info.update(state.get("run_info", {}))  # how the run first started (e.g. the rule that chose the mask)
            missing = sorted(set(shards) - set(store.committed_shards()))
            if missing:
                raise ValueError(f"--resume: shards {missing[:4]} of the checkpointed run are not in {store.path}")
            log(f"fit: resumed from {latest} at step {start_step} "
                f"({start_step * config.train.sequences_per_step:,} samples trained on), {position.describe()}")

        loader = ShardLoader(
            store, config.data, layer_ids, drafter_config.block_size, seed=config.train.seed,
            epochs=config.train.epochs, position=position, log=log, shards=shards, device=device,
        )
        total_steps = config.train.max_steps or max(
            1, config.train.epochs * math.ceil(loader.count_train_samples() / config.train.sequences_per_step)
        )
        config.save(run_dir)
        store_info = {"store": str(store.path), "fingerprint_sha256": store.fingerprint.sha256(), "layer_ids": layer_ids}
        return cls(config, head, drafter, optimizer, loader, total_steps, device, generator, start_step, store_info,
                   log, run_info)

    # -- one sequence ------------------------------------------------------------------------
    def run_sequence(self, sample: TrainSample, generator: torch.Generator, noise: float | None = None):
        """dflash_step on one loader sample: (LossOutput, anchors, BlockTargets).
        `noise` overrides `loss.noise` (the held-out pass scores with 0)."""
        loss = self.config.loss if noise is None else dataclasses.replace(self.config.loss, noise=noise)
        device = self.device
        with self._autocast():
            return dflash_step(
                self.drafter,
                self.head,
                sample.input_ids.to(device),
                sample.loss_mask.to(device),
                sample.context_features(device),
                loss,
                self.config.model,
                generator,
                target_topk_ids=sample.topk_ids,
                target_topk_logprobs=sample.topk_logprobs,
            )

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train until `total_steps` or the loader's epochs run out. Returns the last log record."""
        train, every = self.config.train, self.config.eval.every
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / LOG_FILE
        truncate_log(log_path, self.step)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.drafter.train()
        sums = MetricSums(self.drafter.config.block_size)
        interval_start, wait_start = time.perf_counter(), self.loader.wait_seconds
        last: dict = {}
        progress = fit_progress(self.total_steps, self.step, train.progress_interval)
        rng = ckpt.rng_state(self.generator)  # every RNG as of the last completed step
        try:
            while self.step < self.total_steps:
                lr = lr_at(self.step, self.total_steps, self.config.optim)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                samples = list(itertools.islice(self.loader, train.sequences_per_step))
                if len(samples) < train.sequences_per_step:
                    break  # out of data: a partial step is dropped
                step_sums = self.backward_step(samples)
                clip = self.config.optim.grad_clip or float("inf")  # 0 disables clipping
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
                with sigint_deferred():  # a step is applied whole or not at all
                    self.optimizer.step()
                    self.step += 1
                    self.position, self.epoch = samples[-1].position, samples[-1].epoch
                    rng = ckpt.rng_state(self.generator)
                sums.merge(step_sums)
                record: dict = {}
                if self.step % train.log_every == 0 or self.step == self.total_steps:
                    elapsed = max(time.perf_counter() - interval_start, 1e-9)
                    record = {
                        "step": self.step,
                        "epoch": self.epoch,
                        "lr": lr,
                        **sums.means(),
                        "grad_norm": grad_norm,
                        "tokens_per_s": sums.tokens / elapsed,
                        "loader_wait_frac": (self.loader.wait_seconds - wait_start) / elapsed,
                    }
                    sums = MetricSums(self.drafter.config.block_size)
                if every and self.step % every == 0:
                    record = {"step": self.step, "epoch": self.epoch, **record, **self.evaluate()}
                if record:
                    append_log(log_path, record)
                    last = record
                    progress.show(**headline(record))
                    interval_start, wait_start = time.perf_counter(), self.loader.wait_seconds
                if train.checkpoint_every and self.step % train.checkpoint_every == 0:
                    self.save_checkpoint()
                progress.update(1, tokens=step_sums.tokens, samples=f"{self.step * train.sequences_per_step:,}")
            if every and self._last_eval_step != self.step:  # the final model is always evaluated
                record = {"step": self.step, "epoch": self.epoch, **self.evaluate()}
                append_log(log_path, record)
                last = {**last, **record}
            if not (train.checkpoint_every and self.step % train.checkpoint_every == 0):
                self.save_checkpoint()
        except KeyboardInterrupt:
            ckpt.restore_rng(*rng, self.generator)  # as the last completed step left them
            raise TrainingInterrupted(self.step, self.checkpoint_on_interrupt()) from None
        finally:
            progress.close()
            self.loader.close()
        if self.loader.skipped_shards:
            self.log(f"skipped corrupt shards (never trained on): {self.loader.skipped_shards}")
        return last

    def backward_step(self, samples: list[TrainSample]) -> MetricSums:
        """Gradients of one optimizer step over `samples` (the global batch), each
        sequence its own forward and backward. `loss.normalize="step"`: the loss
        is normalised over all weighted labels of the step, so each sequence's own
        normalised loss counts by its label weight (`BlockTargets.weight_sum`) and
        the summed gradients are divided by the step's total weight; "sequence":
        the mean of the sequences' own normalised losses."""
        self.optimizer.zero_grad(set_to_none=True)
        per_step = self.config.loss.normalize == "step"
        sums = MetricSums(self.drafter.config.block_size)
        total = 0.0
        for sample in samples:
            output, _, targets = self.run_sequence(sample, self.generator)
            scale = float(targets.weight_sum) if per_step else 1.0
            (output.loss * scale).backward()
            total += scale
            sums.add(float(output.loss.detach()), output.metrics, targets, sample.num_tokens)
        if total > 0:
            for param in self.drafter.parameters():
                if param.grad is not None:
                    param.grad.div_(total)
        return sums

    def evaluate(self) -> dict:
        self._last_eval_step = self.step
        result: dict = {}
        for evaluator in self.evaluators:
            result.update(evaluator(self, self.step))
        return result

    def checkpoint_on_interrupt(self) -> Path:
        """The checkpoint of the last completed step (written now unless it already
        is), with a second Ctrl-C ignored while it is written."""
        done = ckpt.checkpoint_dir(self.run_dir, self.step)
        if ckpt.latest_checkpoint(self.run_dir) == done:
            return done
        self.log(f"interrupted: saving a checkpoint of step {self.step}")
        with sigint_deferred(reraise=False):
            return self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        state = {
            "scheduler": {"step": self.step, "total_steps": self.total_steps, "lr": lr_at(max(self.step - 1, 0), self.total_steps, self.config.optim)},
            "loader": {"position": self.position.to_dict(), "shards": self.loader.shards, "shards_sha256": self.loader.shards_sha256,
                       "skipped_shards": self.loader.skipped_shards},
            "epoch": self.epoch,
            "drafter_config": self.drafter.config.to_dict(),
            "config": self.config.to_dict(),
            "heldout_split": heldout_record(self.config.data.heldout_fraction),
            "store": self.store_info,
            "run_info": self.run_info,
        }
        return ckpt.save_checkpoint(
            self.run_dir, self.step, self.drafter, self.optimizer, self.generator, state, keep=self.config.train.keep_checkpoints
        )

