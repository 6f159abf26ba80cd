"""MVUE gradient pruning: the closed-form path (1:2, 2:4), eager and compiled, against the general water-filling path.

All run on the same seeded fp32 gradients in one process, alternating, so a busy machine slows them alike; the
ratios are what to read. ``axis 0`` is how the trainer calls it (``[tokens, out]``, groups along tokens). The
compiled column is ``torch.compile`` of the closed form (what tensors of 64K elements and more get); the eager one
is what ``NMDEPLOY_COMPILE=0`` and smaller tensors get. Writes the ``mvue`` section of BENCHMARKS.md.

    python benchmarks/mvue.py [--shapes 4096x32 4096x256 16384x1024] [--repeats 5] [--device cpu] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from report import machine, write_section

from nmdeploy.masks import Pattern, compiled
from nmdeploy.masks.mvue import _closed_form_prune, _water_filling_prune


def _seconds(call: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _with_compile(enabled: bool, call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``call`` with the closed form's compiled kernel switched on or off."""

    def run() -> torch.Tensor:
        os.environ[compiled.SWITCH] = "1" if enabled else "0"
        return call()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x32", "4096x256", "16384x1024"])
    parser.add_argument("--patterns", nargs="+", default=["1:2", "2:4"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--axes", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = [
        f"`python benchmarks/mvue.py` on {machine()}, {device}, {datetime.date.today()}; median of {args.repeats} "
        "alternating calls per path, after a warm-up call that also compiles.",
        "",
        "| gradient | pattern | axis | general (water-filling) | closed form, eager | closed form, compiled "
        "| compiled vs eager | compiled vs general |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for text in args.shapes:
        rows, cols = (int(size) for size in text.split("x"))
        gradient = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)).to(device)
        for pattern_text in args.patterns:
            pattern = Pattern.parse(pattern_text)
            for axis in args.axes:
                generator = torch.Generator(device=device).manual_seed(0)
                arguments = (gradient, pattern, axis, "dense", generator)
                paths = {
                    "general": partial(_water_filling_prune, *arguments),
                    "eager": _with_compile(False, partial(_closed_form_prune, *arguments)),
                    "compiled": _with_compile(True, partial(_closed_form_prune, *arguments)),
                }
                for call in paths.values():  # warm-up: allocator, first-call dispatch, compiling
                    call()
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.repeats):
                    for name, call in paths.items():
                        times[name].append(_seconds(call, device))
                general, eager, fused = (statistics.median(times[name]) * 1e3 for name in paths)
                line = (
                    f"| {text} | {pattern_text} | {axis} | {general:.2f} ms | {eager:.2f} ms | {fused:.2f} ms "
                    f"| {eager / fused:.1f}x | {general / fused:.1f}x |"
                )
                print(line, flush=True)
                lines.append(line)
    os.environ.pop(compiled.SWITCH, None)
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_section("mvue", "## MVUE gradient pruning (`python benchmarks/mvue.py`)", section)


if __name__ == "__main__":
    main()
