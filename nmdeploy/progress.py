"""Progress of long loops (conversion, recovery, training, benchmarks): a live bar where a person watches, plain
lines elsewhere.

On a terminal (stderr is a TTY) it is a tqdm bar. In logs and CI a bar's carriage-return updates pile up (a
457 s recovery wrote 35 KB of them), so there it is one plain line when the count passes another ``step`` of the
total (5 %), at most one per ``interval`` seconds, and a last line at the end when any was written: a short loop
writes nothing, a long one about twenty lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Protocol

STEP = 0.05
INTERVAL = 10.0


class Progress(Protocol):
    """What a loop reports to: a context manager counting done items, with figures shown beside the count."""

    def __enter__(self) -> Progress: ...

    def __exit__(self, *exc: object) -> None: ...

    def update(self, count: int = 1) -> None: ...

    def set_postfix(self, **figures: object) -> None: ...


def progress_bar(
    total: int | None,
    *,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    initial: int = 0,
    leave: bool = True,
) -> Progress:
    """The progress of a loop of ``total`` items (None: unknown) on stderr: a tqdm bar on a terminal, plain lines
    elsewhere, nothing when not ``enabled``. ``leave=False`` clears the bar when it closes (lines stay)."""
    stream = sys.stderr
    if not enabled:
        return Silent()
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=stream)
    return Lines(total, desc=desc, unit=unit, initial=initial, stream=stream)


class Silent:
    """No output at all: a disabled bar, or a rank that does not report."""

    def __enter__(self) -> Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, count: int = 1) -> None:
        pass

    def set_postfix(self, **figures: object) -> None:
        pass


class Lines:
    """Progress as plain lines for logs: one when the count passes another ``step`` of the total (or, with no total,
    every ``interval`` seconds), never more often than every ``interval`` seconds; a final line when any was written."""

    def __init__(
        self,
        total: int | None,
        *,
        desc: str,
        unit: str,
        stream: IO[str],
        initial: int = 0,
        step: float = STEP,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit, self.stream = total, desc, unit, stream
        self.count, self.step, self.clock = initial, step, clock
        self.interval = INTERVAL if interval is None else interval
        self.figures: dict[str, object] = {}
        self.started = self.last_time = clock()
        self.last_count = initial
        self.written = 0

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.written and self.count != self.last_count:
            self._write()

    def update(self, count: int = 1) -> None:
        self.count += count
        now = self.clock()
        if now - self.last_time < self.interval:
            return
        if self.total and self.count < self.total:
            slices = round(1 / self.step)
            if self.count * slices // self.total == self.last_count * slices // self.total:
                return
        self._write()

    def set_postfix(self, **figures: object) -> None:
        self.figures = figures

    def _write(self) -> None:
        now = self.clock()
        elapsed = now - self.started
        done = f"{self.count}/{self.total}" if self.total else str(self.count)
        line = f"{self.desc}: {done} {self.unit}"
        if self.total:
            line = f"{self.desc}: {self.count / self.total:.0%} ({done} {self.unit})"
        line += f", {elapsed:.0f} s"
        if self.total and 0 < self.count < self.total:
            line += f", about {elapsed * (self.total - self.count) / self.count:.0f} s left"
        line += "".join(f", {name}={value}" for name, value in self.figures.items())
        print(line, file=self.stream, flush=True)
        self.last_time, self.last_count = now, self.count
        self.written += 1
