"""Step schedules of the training methods: when masks are recomputed and how decays and removals progress.

Steps count completed optimiser steps (``Sparsifier.step()`` calls); every schedule is a pure function of the step,
so resuming at step t needs nothing but t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern


def check_count(value: object, what: str, *, minimum: int = 0) -> int:
    """``value`` as an int of at least ``minimum``, or an InputError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{what} must be an integer of at least {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class Every:
    """Due at ``start``, ``start + interval``, ``start + 2 * interval`` ..."""

    interval: int
    start: int = 0

    def __post_init__(self) -> None:
        check_count(self.interval, "mask interval", minimum=1)
        check_count(self.start, "schedule start")

    def due(self, step: int) -> bool:
        return step >= self.start and (step - self.start) % self.interval == 0


@dataclass(frozen=True)
class CombinationRemoval:
    """LBC's alive combinations per group: ``K_t = 1 + ceil((K - 1) * (1 - (t - start) / (end - start)) ** exponent)``.

    ``t`` advances in whole multiples of ``every`` (the reference updates once per epoch: pass the steps per epoch).
    """

    total: int
    start: int
    end: int
    exponent: float = 3.0
    every: int = 1

    def __post_init__(self) -> None:
        check_count(self.total, "number of combinations", minimum=1)
        check_count(self.start, "removal_start")
        check_count(self.every, "removal_every", minimum=1)
        if check_count(self.end, "removal_end", minimum=1) <= self.start:
            raise InputError(f"removal_end ({self.end}) must come after removal_start ({self.start})")
        if not self.exponent > 0:
            raise InputError(f"removal exponent must be positive, got {self.exponent!r}")

    def alive(self, step: int) -> int:
        if step <= self.start:
            return self.total
        quantized = self.start + (step - self.start) // self.every * self.every
        if quantized >= self.end:
            return 1
        remaining = 1.0 - (quantized - self.start) / (self.end - self.start)
        return 1 + math.ceil((self.total - 1) * remaining**self.exponent)

    def finished(self, step: int) -> bool:
        return self.alive(step) == 1


@dataclass(frozen=True)
class LinearDecay:
    """A factor that holds 1 for ``start`` steps, falls linearly to 0 over ``length`` steps, then stays 0."""

    start: int
    length: int

    def __post_init__(self) -> None:
        check_count(self.start, "dense_steps")
        check_count(self.length, "decay_steps", minimum=1)

    def factor(self, step: int) -> float:
        if step <= self.start:
            return 1.0
        return max(0.0, 1.0 - (step - self.start) / self.length)

    def finished(self, step: int) -> bool:
        return step >= self.start + self.length


@dataclass(frozen=True)
class PatternSchedule:
    """Dense for ``start`` steps, then each pattern for an equal share of ``length`` steps, then the last one."""

    patterns: tuple[Pattern, ...]
    start: int
    length: int

    def __post_init__(self) -> None:
        check_count(self.start, "dense_steps")
        check_count(self.length, "decay_steps", minimum=len(self.patterns))

    def pattern(self, step: int) -> Pattern | None:
        """The pattern in force at ``step``; None while still dense."""
        if step < self.start:
            return None
        frame = (step - self.start) * len(self.patterns) // self.length
        return self.patterns[min(frame, len(self.patterns) - 1)]

    def finished(self, step: int) -> bool:
        return step >= self.start + self.length
