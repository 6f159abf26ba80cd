"""A child process run to its end while its resident memory is polled: what the memory benchmarks share."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

POLL_SECONDS = 0.05


@dataclass(frozen=True)
class WatchedRun:
    """The child's exit code and output, its seconds from start to end, the highest resident memory polled (bytes)
    and whether it was stopped for passing the cap."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_bytes: int
    stopped: bool


def resident_bytes(pid: int) -> int:
    """The process's resident memory now (VmRSS), or 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_watched(
    command: Sequence[str], *, cwd: str | Path, env: Mapping[str, str] | None = None, cap: int | None = None
) -> WatchedRun:
    """``command`` run in ``cwd`` with its output captured as text, its resident memory polled every 50 ms; killed
    (``stopped``) once it passes ``cap`` bytes, so that a run that needs far more does not take a shared machine
    down."""
    started = time.perf_counter()
    child = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = [0]
    stopped = threading.Event()

    def poll() -> None:
        while child.poll() is None:
            peak[0] = max(peak[0], resident_bytes(child.pid))
            if cap is not None and peak[0] > cap:
                stopped.set()
                child.kill()
                return
            time.sleep(POLL_SECONDS)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    stdout, stderr = child.communicate()
    watcher.join()
    return WatchedRun(child.returncode, stdout, stderr, time.perf_counter() - started, peak[0], stopped.is_set())
