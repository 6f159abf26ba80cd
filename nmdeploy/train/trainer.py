"""The training loop behind ``nmdeploy train``: seeded, resumable, logged, and distributed-ready.

One :class:`TrainingRun` owns the live objects (model, sparsifier, optimiser, schedule, data sampler) and the
history. Every random draw comes from a seeded source whose state goes into the checkpoint (the data order is a
function of the seed and the epoch), so a run stopped after any step and resumed in a fresh process continues
exactly as if it had never stopped (on CPU). Per epoch it
logs loss, accuracy and the sparse architecture divergence (positions whose keep/prune state flipped, summed over
steps) to ``metrics.csv`` / ``metrics.json``; every step's loss and flips go to ``steps.csv``.

Under ``torchrun`` (``torch.distributed`` initialised before :func:`train`), the model is wrapped in
DistributedDataParallel and torch's DistributedSampler gives every rank its share of each epoch's permutation, so
each global batch of ``batch_size`` is split evenly across the ranks; all ranks build the sparsifier with the same
seed, so masks computed from the synchronised weights agree across ranks.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from nmdeploy.errors import InputError
from nmdeploy.files import write_atomically
from nmdeploy.masks import sparse_architecture_divergence
from nmdeploy.progress import progress_bar
from nmdeploy.reference.digits import DigitsSplits
from nmdeploy.train.checkpoint import (
    Position,
    capture_rng,
    make_payload,
    position_of,
    read_checkpoint,
    restore_rng,
    restoring,
    write_checkpoint,
)
from nmdeploy.train.config import RunConfig, config_from_dict
from nmdeploy.train.masking.sparsify import Sparsifier
from nmdeploy.train.masking.step import STEPAdam
from nmdeploy.train.tasks import build_model, task_of

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass(frozen=True)
class EpochRecord:
    """One line of ``metrics.csv``."""

    epoch: int
    step: int
    lr: float
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    mask_flips: int  # positions whose keep/prune state changed, summed over the epoch's steps
    sad: float  # mask_flips divided by the number of mask positions: flips per weight per epoch
    seconds: float


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path | None  # None when the run diverged: every file it wrote was removed
    epochs: list[EpochRecord]
    step_losses: list[float]
    sparsified: list[str]
    skipped: dict[str, str]
    finished: bool  # False when stopped early by ``stop_after_steps`` or by divergence
    diverged_at_epoch: int | None = None  # the first epoch whose loss is not finite: the run stopped there

    @property
    def test_accuracy(self) -> float:
        return self.epochs[-1].test_accuracy if self.epochs else float("nan")


@dataclass
class _EpochTally:
    """Running sums of the epoch in progress; checkpointed so a mid-epoch resume logs the same epoch line."""

    loss_sum: float = 0.0
    correct: int = 0
    seen: int = 0
    flips: int = 0
    seconds: float = 0.0


@dataclass
class _History:
    epochs: list[EpochRecord] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    step_flips: list[int] = field(default_factory=list)
    tally: _EpochTally = field(default_factory=_EpochTally)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epochs": [dataclasses.asdict(e) for e in self.epochs],
            "step_losses": list(self.step_losses),
            "step_flips": list(self.step_flips),
            "tally": dataclasses.asdict(self.tally),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> _History:
        return cls(
            [EpochRecord(**e) for e in data["epochs"]],
            list(data["step_losses"]),
            list(data["step_flips"]),
            _EpochTally(**data["tally"]),
        )


class TrainingRun:
    """The live state of one training run; :func:`train` drives it, tests and benchmarks may step it directly."""

    def __init__(self, config: RunConfig, *, device: str | None = None, restore: bool = False) -> None:
        self.config = config
        self.device = torch.device(device or _device(config.train.device))
        self.world, self.rank = _distributed()
        train = config.train
        _seed_everything(train.seed)
        splits = task_of(config.task).load_data(config.task.data_seed)
        if config.task.train_size is not None:
            size = config.task.train_size
            splits = DigitsSplits(splits.train_x[:size], splits.train_y[:size], splits.test_x, splits.test_y)
        self.splits = _to_device(splits, self.device)
        self.model, self.sparsifier = build_model(
            config.task, config.sparsity, train.seed, calibration=self._calibration_batches, restore=restore
        )
        self.model.to(self.device)
        if train.batch_size % self.world:
            raise InputError(
                f"[train] batch_size = {train.batch_size} must be a multiple of the {self.world} processes, so that "
                "every global batch is split evenly"
            )
        self.local_batch_size = train.batch_size // self.world
        # The same sampler with one rank when not distributed: each epoch's permutation comes from (seed, epoch).
        self.sampler = DistributedSampler(
            range(len(self.splits.train_x)), num_replicas=self.world, rank=self.rank, shuffle=True, seed=train.seed
        )
        self.steps_per_epoch = math.ceil(len(self.sampler) / self.local_batch_size)
        self.optimizer = _optimizer(self.model, config, self.sparsifier)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_factor(config, self.steps_per_epoch))
        self.position = Position(epoch=0, batch=0, step=0)
        self.history = _History()
        self.loss_function = nn.CrossEntropyLoss()
        self.network: nn.Module = self.model
        if self.world > 1:
            self.network = nn.parallel.DistributedDataParallel(self.model)
        self._order: torch.Tensor | None = None
        self._previous_masks = self.masks()

    def _calibration_batches(self) -> list[torch.Tensor]:
        """The first ``calibration_samples`` training inputs in batches of ``batch_size``, for a one-shot start."""
        inputs = self.splits.train_x[: self.config.sparsity.calibration_samples]
        return list(inputs.split(self.config.train.batch_size))

    # -- state -------------------------------------------------------------------------------------------------

    def masks(self) -> dict[str, torch.Tensor]:
        """The current forward masks, copied (empty for a dense run)."""
        if self.sparsifier is None:
            return {}
        return {name: mask.detach().clone() for name, mask in self.sparsifier.masks().items()}

    def payload(self) -> dict[str, Any]:
        return make_payload(
            config=self.config.to_dict(),
            model_state=self.model.state_dict(),
            sparsifier_state=self.sparsifier.state_dict() if self.sparsifier is not None else None,
            optimizer_state=self.optimizer.state_dict(),
            scheduler_state=self.scheduler.state_dict(),
            rng=capture_rng(),
            position=self.position,
            history=self.history.to_dict(),
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, device: str | None = None) -> TrainingRun:
        """Rebuild a run from a checkpoint, in this process, ready to continue with the next step."""
        payload = read_checkpoint(path)
        run = cls(config_from_dict(payload["config"]), device=device, restore=True)
        with restoring(path):
            run.model.load_state_dict(payload["model"])
            if run.sparsifier is not None:
                run.sparsifier.load_state_dict(payload["sparsifier"])
            run.optimizer.load_state_dict(payload["optimizer"])
            run.scheduler.load_state_dict(payload["scheduler"])
            restore_rng(payload["rng"])
            run.position = position_of(payload)
            run.history = _History.from_dict(payload["history"])
        run._order = None
        run._previous_masks = run.masks()
        return run

    # -- training ----------------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.position.epoch >= self.config.train.epochs

    def _epoch_order(self) -> torch.Tensor:
        """This rank's sample indices for the current epoch; a run resumed mid-epoch gets the same ones back."""
        if self._order is None:
            self.sampler.set_epoch(self.position.epoch)
            self._order = torch.tensor(list(self.sampler), dtype=torch.long)
        return self._order

    def train_step(self) -> float:
        """One optimiser step on the next batch; returns its loss (the global-batch mean under DDP)."""
        order = self._epoch_order()
        start = self.position.batch * self.local_batch_size
        indices = order[start : start + self.local_batch_size]
        x, y = self.splits.train_x[indices], self.splits.train_y[indices]
        begin = time.perf_counter()
        self.network.train()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.network(x)
        loss = self._loss(logits, y)
        loss.backward()
        self.optimizer.step()
        if self.sparsifier is not None:
            self.sparsifier.step()
        self.scheduler.step()
        loss_value, correct, seen = float(loss.detach()), _correct(logits, y), len(y)
        if self.world > 1:  # every rank has the same number of samples (DistributedSampler pads the last batch)
            loss_sum, correct, seen = _all_reduce_sum(loss_value * seen, correct, seen)
            loss_value, seen = loss_sum / seen, int(seen)
        flips = self._count_flips()
        tally = self.history.tally
        tally.loss_sum += loss_value * seen
        tally.correct += correct
        tally.seen += seen
        tally.flips += flips
        tally.seconds += time.perf_counter() - begin
        self.history.step_losses.append(loss_value)
        self.history.step_flips.append(flips)
        batch = self.position.batch + 1
        self.position = Position(self.position.epoch, batch, self.position.step + 1)
        if batch == self.steps_per_epoch:
            self._end_epoch()
        return loss_value

    def _count_flips(self) -> int:
        if self.sparsifier is None:
            return 0
        current = self.masks()
        flips = sum(int(sparse_architecture_divergence(self._previous_masks[k], current[k])) for k in current)
        self._previous_masks = current
        return flips

    def _end_epoch(self) -> None:
        tally = self.history.tally
        test_loss, test_accuracy = self.evaluate()
        positions = sum(m.numel() for m in self._previous_masks.values())
        self.history.epochs.append(
            EpochRecord(
                epoch=self.position.epoch + 1,
                step=self.position.step,
                lr=float(self.optimizer.param_groups[0]["lr"]),
                train_loss=tally.loss_sum / tally.seen,
                train_accuracy=tally.correct / tally.seen,
                test_loss=test_loss,
                test_accuracy=test_accuracy,
                mask_flips=tally.flips,
                sad=tally.flips / positions if positions else 0.0,
                seconds=round(tally.seconds, 3),
            )
        )
        self.history.tally = _EpochTally()
        self.position = Position(self.position.epoch + 1, 0, self.position.step)
        self._order = None

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(mean cross-entropy, top-1 accuracy) on the test split, in eval mode."""
        self.model.eval()
        try:
            logits = self.model(self.splits.test_x)
        finally:
            self.model.train()
        loss = float(self._loss(logits, self.splits.test_y))
        return loss, _correct(logits, self.splits.test_y) / len(self.splits.test_y)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy; per position for ``[batch, positions, classes]`` logits (a language model)."""
        if logits.ndim > 2:
            return self.loss_function(logits.flatten(0, -2), labels.flatten())
        return self.loss_function(logits, labels)


def train(
    config: RunConfig,
    run_dir: str | Path,
    *,
    resume: str | Path | None = None,
    progress: bool = True,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Train ``config``'s task into ``run_dir`` (checkpoint, metrics.csv/json, steps.csv), or continue ``resume``.

    ``stop_after_steps`` stops once that many steps are done in total and saves a checkpoint, as a kill would
    after its last save (used to test exact resumption). A run whose loss stops being finite has failed: it stops
    after that epoch and removes every file and folder it created (the result's epochs say what happened).
    """
    run_dir = Path(run_dir)
    run = TrainingRun.from_checkpoint(resume) if resume is not None else TrainingRun(config)
    if resume is not None and run.config != config:
        raise InputError(f"{resume}: checkpoint was written with a different config; resume it with its own")
    checkpoint = run_dir / CHECKPOINT_NAME
    writer = run.rank == 0
    created_folders = _missing_folders(run_dir)
    existing = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
    if writer:
        run_dir.mkdir(parents=True, exist_ok=True)
    train_config = run.config.train
    stopped = False
    diverged: int | None = None
    while not run.finished and not stopped and diverged is None:
        epoch = run.position.epoch
        bar = progress_bar(
            run.steps_per_epoch,
            initial=run.position.batch,
            desc=f"epoch {epoch + 1}/{train_config.epochs}",
            enabled=progress and writer,
            leave=False,
            unit="step",
        )
        with bar:
            while run.position.epoch == epoch:
                loss = run.train_step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
                if stop_after_steps is not None and run.position.step >= stop_after_steps:
                    stopped = True
                    break
        if run.position.epoch != epoch:
            record = run.history.epochs[-1]
            log.info(
                "epoch %d: loss %.4f, test accuracy %.4f, mask flips %d",
                record.epoch,
                record.train_loss,
                record.test_accuracy,
                record.mask_flips,
            )
            if not (math.isfinite(record.train_loss) and math.isfinite(record.test_loss)):
                diverged = record.epoch
        due = run.position.epoch % train_config.checkpoint_every == 0 or run.finished or stopped
        if writer and due and diverged is None:
            write_checkpoint(checkpoint, run.payload())
            write_logs(run, run_dir)
    if run.world > 1:
        torch.distributed.barrier()
    if writer and diverged is not None:
        _remove_created(run_dir, existing, created_folders)
        log.warning("the loss is not finite from epoch %d: training stopped, %s left as it was", diverged, run_dir)
    sparsified = sorted(run.sparsifier.layers) if run.sparsifier is not None else []
    skipped = dict(run.sparsifier.skipped) if run.sparsifier is not None else {}
    return TrainResult(
        run_dir,
        None if diverged is not None else checkpoint,
        run.history.epochs,
        run.history.step_losses,
        sparsified,
        skipped,
        run.finished,
        diverged,
    )


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_created(run_dir: Path, existing: set[str], created_folders: list[Path]) -> None:
    """Remove what a failed run added: the entries of ``run_dir`` not in ``existing``, then the folders it made."""
    for name in set(os.listdir(run_dir)) - existing:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    for folder in created_folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def write_logs(run: TrainingRun, run_dir: Path) -> None:
    """metrics.csv (one line per epoch), metrics.json (config, layers, epochs) and steps.csv, each atomically."""
    epochs = [dataclasses.asdict(e) for e in run.history.epochs]
    names = [f.name for f in dataclasses.fields(EpochRecord)]
    write_atomically(run_dir / "metrics.csv", _csv(names, [[e[n] for n in names] for e in epochs]))
    steps = zip(
        range(1, len(run.history.step_losses) + 1), run.history.step_losses, run.history.step_flips, strict=True
    )
    write_atomically(run_dir / "steps.csv", _csv(["step", "loss", "mask_flips"], [list(row) for row in steps]))
    summary = {
        "task": run.config.task.label,
        "config": run.config.to_dict(),
        "sparsified": sorted(run.sparsifier.layers) if run.sparsifier is not None else [],
        "skipped": dict(run.sparsifier.skipped) if run.sparsifier is not None else {},
        "finished": run.finished,
        "epochs": epochs,
    }
    write_atomically(run_dir / "metrics.json", json.dumps(summary, indent=2) + "\n")


def _csv(header: list[str], rows: list[list[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def _correct(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Correct examples; an example with several positions counts the fraction of its positions that are right."""
    hits = logits.argmax(dim=-1) == labels
    return float(hits.flatten(1).float().mean(dim=1).sum()) if hits.ndim > 1 else int(hits.sum())


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _device(name: str) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("[train] device = 'cuda' but torch sees no CUDA device; use device = 'cpu'")
    return name


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _all_reduce_sum(*values: float) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor)
    return [float(v) for v in tensor]


def _to_device(splits: DigitsSplits, device: torch.device) -> DigitsSplits:
    return DigitsSplits(*(t.to(device) for t in (splits.train_x, splits.train_y, splits.test_x, splits.test_y)))


def _optimizer(model: nn.Module, config: RunConfig, sparsifier: Sparsifier | None) -> torch.optim.Optimizer:
    train = config.train
    parameters = list(model.parameters())
    if sparsifier is not None and sparsifier.method == "step":
        return STEPAdam(parameters, sparsifier, lr=train.lr, weight_decay=train.weight_decay)
    if train.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.Adam(parameters, lr=train.lr, weight_decay=train.weight_decay)


def _lr_factor(config: RunConfig, steps_per_epoch: int):
    """Linear warm-up from 0, then constant or cosine to 0 at the last step, as a function of the step count."""
    total = config.train.epochs * steps_per_epoch
    warmup = config.train.warmup_epochs * steps_per_epoch
    cosine = config.train.schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, total - warmup) / max(1, total - warmup)))

    return factor
