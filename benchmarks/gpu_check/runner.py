"""Running the sections on the device: the run's state and ``results.json``, the time budget, and one section at a
time within its limit (a failure, a skip or a timeout is recorded and the next section still runs)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpu_check.common import RESULTS, STARTED, progress


class SectionSkipped(Exception):
    """A section found, once started, that it should not run (what it needed is missing, or it would not fit)."""


class SectionTimeout(BaseException):
    """A section ran past its own time limit (a BaseException, so that no ``except Exception`` inside the code it
    interrupts swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in this (main) thread after ``seconds``; Python code in long loops sees it at once."""

    def expire(signum, frame):
        raise SectionTimeout(f"stopped at its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Run:
    """The run's state: where results go, the time budget, the device and the scratch folder."""

    out: Path
    carry: Path | None
    budget: float
    smoke: bool
    device: str
    started: float = STARTED
    results: dict = field(default_factory=dict)
    scratch: Path | None = None
    long_steps: int | None = None  # --long-steps: the long recovery's steps, when not the plan's
    shapes: dict | None = None
    manifest: dict | None = None

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def save(self) -> None:
        from nmdeploy.files import write_atomically

        self.results["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        write_atomically(self.out / RESULTS, json.dumps(self.results, indent=1, default=str))


def on_cuda(run: Run) -> bool:
    return run.device.startswith("cuda")


def run_section(run: Run, name: str, body: Callable[[Run, dict], None], limit: float, needs: float) -> None:
    """Run one section within ``limit`` seconds (skipped when fewer than ``needs`` seconds are left), recording
    its status, error, time and peak CUDA memory; ``body`` fills the record it is given as it goes."""
    record: dict = {"status": "running"}
    run.results["sections"][name] = record
    left = run.left()
    limit = min(limit, left - 5)
    if limit < needs:
        record.update(status="skipped", reason=f"{left:.0f} s of the budget left, the section needs about {needs:.0f}")
        progress(f"{name}: skipped ({record['reason']})")
        run.save()
        return
    progress(f"{name}: start (limit {limit:.0f} s, {left:.0f} s of the budget left)")
    started = time.perf_counter()
    torch = sys.modules.get("torch")
    if torch is not None and on_cuda(run):
        torch.cuda.reset_peak_memory_stats()
    try:
        with time_limit(limit):
            body(run, record)
        record["status"] = "ok"
    except SectionTimeout as error:
        record.update(status="timeout", error=str(error))
    except SectionSkipped as error:
        record.update(status="skipped", reason=str(error))
    except BaseException as error:  # noqa: BLE001 - a section's failure is a result; the next section still runs
        if isinstance(error, KeyboardInterrupt):
            raise
        record.update(status="error", error=f"{type(error).__name__}: {error}"[:2000],
                      traceback=traceback.format_exc()[-4000:])  # fmt: skip
    finally:
        record["seconds"] = round(time.perf_counter() - started, 2)
        if torch is not None and on_cuda(run):
            with contextlib.suppress(Exception):
                record["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        run.save()
    progress(
        f"{name}: {record['status']} in {record['seconds']} s"
        + (f" ({record.get('error')})" if "error" in record else "")
    )
