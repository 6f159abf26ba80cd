"""The ``[sparsity]`` table of a run: :func:`~nmdeploy.train.masking.sparsify.sparsify`'s arguments as one typed
value, checked against the registered method and backward names."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from nmdeploy.errors import InputError, PatternError
from nmdeploy.masks import Pattern
from nmdeploy.train.masking.backward import BACKWARD_CHOICES
from nmdeploy.train.masking.methods import METHODS
from nmdeploy.train.masking.oneshot import INITS
from nmdeploy.train.masking.selection import KEEP_DENSE
from nmdeploy.train.masking.sparsify import Sparsifier, sparsify

DENSE = "dense"
"""The method name of a run that trains the unmodified model."""


def method_names() -> tuple[str, ...]:
    """Every ``[sparsity] method``: dense, then the registered methods."""
    return (DENSE, *METHODS)


@dataclass(frozen=True)
class SparsityConfig:
    """Arguments of ``sparsify``; ``method = "dense"`` trains the unmodified model."""

    method: str = DENSE
    pattern: str = "2:4"
    backward: tuple[str, ...] = ("dense",)
    include: str | None = None
    exclude: str | None = None
    dense_layers: tuple[str, ...] = ()  # layer names or regular expressions, or "first"/"last"
    keep_dense: str = "auto"  # auto (output heads, embeddings), first-last, none
    init: str = "magnitude"  # the first masks: magnitude, or sparsegpt from calibration batches
    calibration_samples: int = 256  # training examples sparsegpt measures (the first ones, in batches)
    options: dict[str, Any] = field(default_factory=dict)  # method and backward options, passed through as keywords

    @property
    def enabled(self) -> bool:
        return self.method != DENSE

    def check(self, where: str = "[sparsity]") -> None:
        """Names and values an :class:`InputError` would otherwise only stop later."""
        _one_of(self.method, method_names(), f"{where} method")
        _one_of(self.keep_dense, KEEP_DENSE, f"{where} keep_dense")
        _one_of(self.init, INITS, f"{where} init")
        for option in self.backward:
            _one_of(option, BACKWARD_CHOICES, f"{where} backward")
        if self.init != "magnitude" and not self.enabled:
            raise InputError(f"{where} init = {self.init!r} chooses first masks, but method = 'dense' trains none")
        if self.calibration_samples < 1:
            raise InputError(f"{where} calibration_samples must be at least 1, not {self.calibration_samples}")
        try:
            Pattern.parse(self.pattern)
        except PatternError as error:
            raise InputError(f"{where} pattern: {error}") from error

    def apply(
        self, model: nn.Module, *, seed: int, calibration: Iterable[Any] | None = None, restore: bool = False
    ) -> Sparsifier | None:
        """Sparsify ``model`` as configured (None for a dense run); ``calibration`` feeds ``init = "sparsegpt"``.
        ``restore``: the model's state comes from a checkpoint next, so the first masks are not worth computing."""
        if not self.enabled:
            return None
        backward: str | tuple[str, ...] = self.backward[0] if len(self.backward) == 1 else self.backward
        sparsifier = sparsify(
            model,
            pattern=self.pattern,
            method=self.method,
            backward=backward,
            include=self.include,
            exclude=self.exclude,
            dense_layers=self.dense_layers,
            keep_dense=self.keep_dense,
            init="magnitude" if restore else self.init,
            calibration=calibration,
            **{"seed": seed, **self.options},  # one seed for the sparsifier's generators on every rank
        )
        if not sparsifier.layers:
            reasons = sorted(set(sparsifier.skipped.values()))[:3]
            raise InputError(
                f"[sparsity] {self.method} {self.pattern}: no layer can take it"
                f"{' (' + '; '.join(reasons) + ')' if reasons else ''}; choose another pattern or include"
            )
        return sparsifier


def _one_of(value: str, choices: tuple[str, ...], where: str) -> None:
    if value not in choices:
        raise InputError(f"{where} = {value!r} is not one of {', '.join(choices)}")
