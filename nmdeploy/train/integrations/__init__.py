"""Callbacks that drive a :class:`~nmdeploy.train.Sparsifier` from the training loops people already use.

``nmdeploy.train.integrations.huggingface.SparsityCallback`` (a ``transformers.TrainerCallback``) and
``nmdeploy.train.integrations.lightning.SparsityCallback`` (a ``lightning.pytorch.Callback``) each step the
sparsifier after every optimiser step, keep its state with the trainer's checkpoints, and log mask flips and SAD
through the trainer's logging. Each module imports its framework when it is imported itself, never before, so
nmdeploy works without either installed.
"""

from __future__ import annotations

from typing import Any

import torch

from nmdeploy.errors import InputError
from nmdeploy.masks import sparse_architecture_divergence
from nmdeploy.train.masking.sparsify import Sparsifier, sparsify


def sparsifier_of(target: Any, options: dict[str, Any]) -> Sparsifier:
    """A callback's sparsifier: ``target`` itself, or the model ``target`` sparsified with ``sparsify``'s keyword
    ``options`` (pattern, method, init, calibration, ...), so a callback takes the same options as ``sparsify``."""
    if isinstance(target, Sparsifier):
        if options:
            raise InputError(
                f"SparsityCallback got a Sparsifier and sparsify options ({', '.join(sorted(options))}); give a model "
                "with the options, or the sparsifier alone"
            )
        return target
    if isinstance(target, torch.nn.Module):
        return sparsify(target, **options)
    raise InputError(f"SparsityCallback needs a Sparsifier or the torch model to sparsify, not {type(target).__name__}")


STATE_FILE = "nmdeploy_sparsifier.pt"
"""Name of the sparsifier's state file inside a Hugging Face checkpoint folder."""


class FlipCounter:
    """Steps a sparsifier and counts mask flips (positions whose keep/prune state changed) since the last read."""

    def __init__(self, sparsifier: Sparsifier) -> None:
        self.sparsifier = sparsifier
        self.flips = 0
        self.steps = 0
        self._previous = self._copy()

    def _copy(self) -> dict[str, torch.Tensor]:
        return {name: mask.detach().clone() for name, mask in self.sparsifier.masks().items()}

    @property
    def positions(self) -> int:
        return sum(mask.numel() for mask in self._previous.values())

    def step(self) -> None:
        """One optimiser step done: advance the sparsifier and count what its masks did."""
        self.sparsifier.step()
        current = self._copy()
        self.flips += sum(int(sparse_architecture_divergence(self._previous[k], v)) for k, v in current.items())
        self._previous = current
        self.steps += 1

    def read(self) -> dict[str, float]:
        """``sparsity/mask_flips`` and ``sparsity/sad`` (flips per mask position) since the last read, then reset."""
        metrics = {
            "sparsity/mask_flips": float(self.flips),
            "sparsity/sad": self.flips / self.positions if self.positions else 0.0,
        }
        self.flips = self.steps = 0
        return metrics

    def resync(self) -> None:
        """Forget the masks seen so far (after a checkpoint was loaded into the model)."""
        self._previous = self._copy()
        self.flips = self.steps = 0


def load_state(path: Any) -> dict[str, Any]:
    """Read a sparsifier state file written by a callback (``weights_only``: plain tensors and lists only)."""
    return torch.load(path, map_location="cpu", weights_only=True)
