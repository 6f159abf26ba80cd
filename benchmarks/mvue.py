"""MVUE gradient pruning: the closed-form path (1:2, 2:4) against the general water-filling path, side by side.

Both run on the same seeded fp32 gradients in one process, alternating, so a busy machine slows both alike; the
ratio is what to read. ``axis 0`` is how the trainer calls it (``[tokens, out]``, groups along tokens).

    python benchmarks/mvue.py [--shapes 4096x32 4096x256 16384x1024] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from report import machine

from nmdeploy.masks import Pattern
from nmdeploy.masks.mvue import _closed_form_prune, _water_filling_prune


def _seconds(call: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["4096x32", "4096x256", "16384x1024"])
    parser.add_argument("--patterns", nargs="+", default=["1:2", "2:4"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--axes", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {device}")
    print(f"{'shape':>12} {'pattern':>7} {'axis':>4} {'general ms':>11} {'closed ms':>10} {'speed-up':>9}")
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
                    "closed": partial(_closed_form_prune, *arguments),
                }
                for call in paths.values():  # warm-up: allocator, first-call dispatch
                    call()
                times: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.repeats):
                    for name, call in paths.items():
                        times[name].append(_seconds(call, device))
                general = statistics.median(times["general"])
                closed = statistics.median(times["closed"])
                print(
                    f"{text:>12} {pattern_text:>7} {axis:>4} {general * 1e3:11.2f} {closed * 1e3:10.2f} "
                    f"{general / closed:8.1f}x"
                )


if __name__ == "__main__":
    main()
