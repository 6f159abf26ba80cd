"""What every benchmark script shares: the machine line and writing its section of BENCHMARKS.md atomically."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}"
    )


def write_section(key: str, heading: str, section: str) -> None:
    """Replace the text between the ``key`` markers of BENCHMARKS.md (appending it under ``heading`` the first time)."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    block = f"{begin}\n{section}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n{block}\n"
    tmp = BENCHMARKS_MD.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(BENCHMARKS_MD)
