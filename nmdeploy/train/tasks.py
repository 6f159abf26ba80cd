"""The reference training tasks: a model builder, its data and its ONNX export, looked up by name from a config.

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

import torch
from torch import nn

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
