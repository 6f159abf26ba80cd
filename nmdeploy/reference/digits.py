"""A small CNN on scikit-learn's 8x8 digits: a reference classifier that trains to >= 95 % in seconds on a CPU.

The data ship with scikit-learn (1797 images, 10 classes), so nothing is downloaded. Images are float32
``[B, 1, 8, 8]`` scaled to [0, 1] (pixel / 16). Every channel count past the first convolution is a multiple of 4,
so 2:4 along the input channels divides every weight but the first convolution's (one input channel).
:class:`DigitsTransformer` reads the same images as sequences of rows, for the trainer's attention paths.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.files import commit_exported, temporary_folder_beside
from nmdeploy.imports import require
from nmdeploy.reference import batch_file_name, write_npz

CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)
INPUT_NAME = "image"
OUTPUT_NAME = "logits"
TEST_SIZE = 450
OPSET = 17
MAX_IR_VERSION = 10


class DigitsCNN(nn.Module):
    """Three 3x3 convolutions with BatchNorm and two max-pools, then a two-layer classifier head.

    ``seed`` makes the initial weights reproducible without touching the global random state.
    """

    def __init__(self, *, seed: int | None = None) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1),
                nn.BatchNorm2d(32),
                nn.ReLU(),
                nn.MaxPool2d(2),  # 8x8 -> 4x4
                nn.Conv2d(32, 64, 3, padding=1),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(2),  # 4x4 -> 2x2
            )
            self.classifier = nn.Sequential(
                nn.Flatten(),
                nn.Linear(64 * 2 * 2, 128),
                nn.ReLU(),
                nn.Linear(128, CLASSES),
            )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(image))


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
class DigitsSplits:
    """A stratified train/test split: images float32 [N, 1, 8, 8] in [0, 1], labels int64 [N]."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def digits_splits(seed: int = 0) -> DigitsSplits:
    """scikit-learn's digits split 1347 / 450, stratified by class, the same for the same ``seed``."""
    require("sklearn", purpose="the digits data", package="scikit-learn", install="pip install 'nmdeploy[models]'")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=TEST_SIZE, stratify=labels, random_state=seed
    )
    return DigitsSplits(
        torch.from_numpy(np.ascontiguousarray(train_x)),
        torch.from_numpy(train_y),
        torch.from_numpy(np.ascontiguousarray(test_x)),
        torch.from_numpy(test_y),
    )


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """Top-1 accuracy of ``model`` in eval mode; the model's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        correct = sum(
            int((model(x[start : start + batch]).argmax(dim=1) == y[start : start + batch]).sum())
            for start in range(0, len(x), batch)
        )
    finally:
        model.train(was_training)
    return correct / len(x)


def train_digits(
    model: nn.Module,
    splits: DigitsSplits,
    *,
    epochs: int = 8,
    lr: float = 5e-3,
    batch: int = 128,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> float:
    """Dense training with Adam on shuffled mini-batches; returns the test accuracy.

    The batch order comes from a generator seeded with ``seed``, so the same model, splits and seed give the same
    weights on CPU. Training runs on one thread: for a model this small, more threads only add synchronisation
    (several times slower on a busy machine), and one thread keeps the result independent of the core count.
    The model is left in eval mode.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train(model, splits, epochs=epochs, lr=lr, batch=batch, weight_decay=weight_decay, seed=seed)
        return accuracy(model, splits.test_x, splits.test_y)
    finally:
        torch.set_num_threads(threads)


def _train(
    model: nn.Module, splits: DigitsSplits, *, epochs: int, lr: float, batch: int, weight_decay: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(splits.train_x) / batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    loss_function = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(splits.train_x), generator=generator)
        for start in range(0, len(order), batch):
            indices = order[start : start + batch]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_function(model(splits.train_x[indices]), splits.train_y[indices])
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()


def export_digits_onnx(model: nn.Module, path: str | Path) -> Path:
    """Export ``model`` (eval mode) with the TorchScript exporter: input "image" [batch, 1, 8, 8], output "logits".

    Opset 17 and IR version <= 10, which every ONNX Runtime since 1.16 loads. The exporter folds each BatchNorm
    into the convolution before it. The file is written beside ``path`` and renamed into place.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    was_training = model.training
    model.eval()
    example = torch.zeros(2, *IMAGE_SHAPE)
    try:
        with temporary_folder_beside(target) as folder:
            exported = Path(folder) / target.name
            with warnings.catch_warnings():
                # The TorchScript exporter is chosen on purpose (fast, single file); its deprecation notice is noise.
                warnings.simplefilter("ignore", DeprecationWarning)
                torch.onnx.export(
                    model,
                    (example,),
                    str(exported),
                    dynamo=False,
                    opset_version=OPSET,
                    input_names=[INPUT_NAME],
                    output_names=[OUTPUT_NAME],
                    dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                )
            proto = onnx.load(str(exported))
            if proto.ir_version > MAX_IR_VERSION:
                proto.ir_version = MAX_IR_VERSION
                onnx.save(proto, str(exported))
            commit_exported(folder, target)
    finally:
        model.train(was_training)
    return target


def digits_npz(x: torch.Tensor | np.ndarray, path_or_folder: str | Path, batch: int = 64) -> list[Path]:
    """Write images as .npz files {"image": float32 [b, 1, 8, 8]}, the format of ``--calib`` and ``--data``.

    A path ending in ``.npz`` gets all of ``x`` in one file; anything else is a folder that gets one file per
    ``batch`` images, named in batch order. Returns the files written.
    """
    images = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    images = images.astype(np.float32, copy=False)
    if images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise InputError(f"digits images must be [N, 1, 8, 8], got {list(images.shape)}")
    if batch < 1:
        raise InputError(f"batch must be at least 1, got {batch}")
    destination = Path(path_or_folder)
    if destination.suffix == ".npz":
        return [write_npz({INPUT_NAME: images}, destination)]
    return [
        write_npz({INPUT_NAME: images[start : start + batch]}, destination / batch_file_name(index))
        for index, start in enumerate(range(0, len(images), batch))
    ]
