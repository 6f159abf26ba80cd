"""Training tasks: a model builder, its data and its ONNX export, looked up from a config's ``[task]`` table.

A task is either a reference task named by ``name`` or a user's own, given by two import paths: ``model =
"mypkg.models:make_model"`` (a callable with no arguments returning the ``nn.Module``, called under the run's seed)
and ``data = "mypkg.data:splits"`` (a callable with no arguments returning four tensors ``train_x, train_y, test_x,
test_y``, or an object with those attributes). The model maps a batch of ``x`` to logits ``[batch, classes]``, or
``[batch, positions, classes]`` against labels ``[batch, positions]`` (a language model); the loss is cross-entropy.

Both tasks train on scikit-learn's digits, which ship with the package, so training needs no download:

- ``digits-cnn``: :class:`nmdeploy.reference.digits.DigitsCNN` (convolutions with BatchNorm, then two Linear layers).
- ``digits-transformer``: :class:`DigitsTransformer`, a two-block pre-norm transformer encoder that reads each
  8x8 image as a sequence of its 8 rows (8 features per token). It exercises what the CNN does not, Linear layers
  on 3-D activations (exported as MatMul with a pre-transposed weight) and attention, on real data, in seconds.
  The bundled MiniLM sentences have no labels, so they cannot train a classifier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.imports import import_callable as resolve_callable
from nmdeploy.reference.digits import CLASSES, DigitsCNN, DigitsSplits, digits_splits, export_digits_onnx


class SelfAttention(nn.Module):
    """Multi-head self-attention written with plain Linear layers, so every projection can be sparsified."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = 1.0 / math.sqrt(width // heads)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length, width = tokens.shape
        qkv = self.qkv(tokens).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        weights = torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, length, width))


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens + self.attention(self.norm1(tokens))
        return tokens + self.mlp(self.norm2(tokens))


class DigitsTransformer(nn.Module):
    """Image rows as tokens -> linear embedding + learned positions -> encoder blocks -> mean pool -> classifier.

    Input and output match :class:`DigitsCNN` (``[B, 1, 8, 8]`` -> logits ``[B, 10]``), so both share data and
    export. Widths are multiples of 4; the embedding (8 inputs) and the head are the first and last layers.
    """

    def __init__(self, *, width: int = 32, heads: int = 4, hidden: int = 64, blocks: int = 2, seed: int | None = None):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.embed = nn.Linear(8, width)
            self.position = nn.Parameter(torch.randn(8, width) * 0.02)
            self.blocks = nn.Sequential(*(EncoderBlock(width, heads, hidden) for _ in range(blocks)))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, CLASSES)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(image.flatten(1, 2)) + self.position  # [B, 1, 8, 8] -> 8 tokens of 8 features
        return self.head(self.norm(self.blocks(tokens)).mean(dim=1))


@dataclass(frozen=True)
class Task:
    """What a run needs to know about a reference task."""

    description: str
    build_model: Callable[[int], nn.Module]  # seed -> freshly initialised model
    load_data: Callable[[int], DigitsSplits]  # data seed -> train/test split
    export_onnx: Callable[[nn.Module, Path], Path]  # eval-mode model -> ONNX file, written atomically


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


def task_of(config: Any) -> NamedTask:
    """The task a ``[task]`` table describes (a :class:`nmdeploy.train.config.TaskConfig`)."""
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

    def export(model: nn.Module, path: Path) -> Path:
        from nmdeploy.train.export import export_onnx

        example = load(config.data_seed).test_x[:2]
        names = {"input_names": ["input"], "output_names": ["output"]}
        axes = {"input": {0: "batch"}, "output": {0: "batch"}}
        return export_onnx(model, (example,), path, **names, dynamic_axes=axes)

    return NamedTask(f"{config.model} on {config.data}", build, load, export, name=config.model)


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
