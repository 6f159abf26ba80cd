"""Training tasks: a model builder, its data and its ONNX export, looked up from a config's ``[task]`` table, and
:func:`build_model`, which builds a run's model (from pretrained ``weights`` where given) and sparsifies it.

A task is either a reference task named by ``name`` or a user's own, given by two import paths: ``model =
"mypkg.models:make_model"`` (a callable with no arguments returning the ``nn.Module``, called under the run's seed)
and ``data = "mypkg.data:splits"`` (a callable with no arguments returning four tensors ``train_x, train_y, test_x,
test_y``, or an object with those attributes). The model maps a batch of ``x`` to logits ``[batch, classes]``, or
``[batch, positions, classes]`` against labels ``[batch, positions]`` (a language model); the loss is cross-entropy.

Both tasks train on scikit-learn's digits, which ship with the package, so training needs no download:

- ``digits-cnn``: :class:`nmdeploy.reference.digits.DigitsCNN` (convolutions with BatchNorm, then two Linear layers).
- ``digits-transformer``: :class:`nmdeploy.reference.digits.DigitsTransformer`, a two-block pre-norm transformer
  encoder that reads each 8x8 image as a sequence of its 8 rows (8 features per token). It exercises what the CNN
  does not, Linear layers on 3-D activations (exported as MatMul with a pre-transposed weight) and attention.
  The bundled MiniLM sentences have no labels, so they cannot train a classifier.

``weights`` names a file of pretrained weights for the model (a state dict, or a checkpoint of a dense run), read
with ``weights_only=True``: sparse fine-tuning starts from it, with the first masks as ``[sparsity] init`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.files import load_torch_file
from nmdeploy.imports import import_callable as resolve_callable
from nmdeploy.reference.digits import DigitsCNN, DigitsSplits, DigitsTransformer, digits_splits, export_digits_onnx
from nmdeploy.train.masking.settings import SparsityConfig
from nmdeploy.train.masking.sparsify import Sparsifier


@dataclass(frozen=True)
class TaskConfig:
    """Which model and data set to train: a reference task by ``name`` (:data:`TASKS`), or a user's ``model`` and
    ``data`` factories as import paths ``"package.module:function"``; ``weights``: pretrained weights to start from."""

    name: str = ""
    model: str | None = None
    data: str | None = None
    data_seed: int = 0
    train_size: int | None = None  # use only the first this many training examples (quick runs and tests)
    weights: str | None = None  # a state dict or a dense run's checkpoint.pt, loaded before sparsifying

    @property
    def label(self) -> str:
        """The task's name, or the model's import path for a user's task."""
        return self.name or str(self.model)

    def check(self) -> None:
        """A known task name or two importable factories, and sensible sizes."""
        if self.model is None and self.data is None:
            if self.name not in TASKS:
                raise InputError(f"[task] name = {self.name!r} is not one of {', '.join(TASKS)}")
        elif self.name or self.model is None or self.data is None:
            raise InputError("[task] give either name (a reference task) or both model and data (import paths)")
        else:
            import_callable(self.model, "model")
            import_callable(self.data, "data")
        if self.train_size is not None and self.train_size < 1:
            raise InputError(f"[task] train_size must be at least 1, not {self.train_size}")


@dataclass(frozen=True)
class Task:
    """What a run needs to know about a reference task."""

    description: str
    build_model: Callable[[int], nn.Module]  # seed -> freshly initialised model
    load_data: Callable[[int], DigitsSplits]  # data seed -> train/test split
    export_onnx: Callable[[nn.Module, Path], Path] | None  # eval-mode model -> ONNX file; None: traced on test data


TASKS: dict[str, Task] = {
    "digits-cnn": Task(
        "DigitsCNN (3 conv + BatchNorm, 2 Linear) on scikit-learn's 8x8 digits",
        lambda seed: DigitsCNN(seed=seed),
        digits_splits,
        export_digits_onnx,
    ),
    "digits-transformer": Task(
        "2-block transformer encoder on digits rows (8 tokens of 8 features)",
        lambda seed: DigitsTransformer(seed=seed),
        digits_splits,
        export_digits_onnx,
    ),
}


@dataclass(frozen=True)
class NamedTask(Task):
    name: str = ""


def task_of(config: TaskConfig) -> NamedTask:
    """The task a ``[task]`` table describes."""
    if config.model is None:
        task = TASKS[config.name]
        return NamedTask(task.description, task.build_model, task.load_data, task.export_onnx, name=config.name)
    factory, data = import_callable(config.model, "model"), import_callable(config.data, "data")

    def build(seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = factory()
        if not isinstance(model, nn.Module):
            raise InputError(f"[task] model {config.model!r} returned {type(model).__name__}, not a torch nn.Module")
        return model

    def load(data_seed: int) -> DigitsSplits:
        return _splits(data(), config.data)

    return NamedTask(f"{config.model} on {config.data}", build, load, None, name=config.model)


def build_model(
    task: TaskConfig,
    sparsity: SparsityConfig,
    seed: int,
    *,
    calibration: Callable[[], list[Any]] | None = None,
    restore: bool = False,
) -> tuple[nn.Module, Sparsifier | None]:
    """The task's model, sparsified as configured: ``(model, sparsifier or None)``.

    A fresh run starts from ``task.weights`` when given and takes its first masks as ``sparsity.init`` says, on the
    batches ``calibration()`` returns; with ``restore`` the state comes from a checkpoint next, so neither is read.
    """
    model = task_of(task).build_model(seed)
    if not restore and task.weights is not None:
        load_weights(model, task.weights)
    batches = calibration() if calibration is not None and not restore and sparsity.init != "magnitude" else None
    return model, sparsity.apply(model, seed=seed, calibration=batches, restore=restore)


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load pretrained weights into the dense ``model``: a state dict, or the ``model`` entry of a checkpoint of a
    dense run; anything else is an :class:`InputError` naming the file."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"[task] weights = {str(path)!r}: no such file; give a state dict or checkpoint.pt")
    state = load_torch_file(source, "state dict or checkpoint")
    if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
        state = state["model"]
    if not isinstance(state, Mapping) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise InputError(f"{source}: not a state dict of tensors (nor a checkpoint holding one)")
    if any(".parametrizations." in key for key in state):
        raise InputError(
            f"{source}: the weights of a sparse run (parametrised layers); resume that run with --resume, or export "
            "it and start from a dense model's weights"
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        lines = str(error).splitlines()
        detail = " ".join(line.strip() for line in lines[1:3])[:300] or lines[0][:300]
        raise InputError(f"{source}: the weights do not fit the task's model ({detail})") from None


def import_callable(path: str, what: str, *, flag: str | None = None) -> Callable[[], Any]:
    """``"package.module:attribute"`` -> that callable; a bad path is an :class:`InputError` naming it, as the
    ``[task]`` entry ``what`` or, given ``flag``, as that command-line flag."""
    return resolve_callable(path, f"{flag} {path!r}" if flag else f"[task] {what} = {path!r}")


def _splits(data: Any, where: str) -> DigitsSplits:
    names = ("train_x", "train_y", "test_x", "test_y")
    values = [getattr(data, n) for n in names] if all(hasattr(data, n) for n in names) else data
    if not isinstance(values, list | tuple) or len(values) != 4 or not all(isinstance(v, torch.Tensor) for v in values):
        raise InputError(
            f"[task] data {where!r} must return four tensors (train_x, train_y, test_x, test_y), "
            f"not {type(data).__name__}"
        )
    train_x, train_y, test_x, test_y = values
    if len(train_x) != len(train_y) or len(test_x) != len(test_y) or not len(train_x) or not len(test_x):
        raise InputError(f"[task] data {where!r}: inputs and labels must be non-empty and of equal length")
    return DigitsSplits(train_x, train_y, test_x, test_y)
