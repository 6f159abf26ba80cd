"""Timing on the device: the median of blocks of calls (CUDA events on the GPU), and a call captured once in a CUDA
graph and replayed, so that the host's per-call dispatch is not timed."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def time_call(fn: Callable[[], object], cuda: bool, min_block_ms: float = 1.0, repeats: int = 5) -> float:
    """Median milliseconds per call: warm-up, then ``repeats`` blocks of enough calls to fill ``min_block_ms``,
    timed with CUDA events on the GPU (launches included), perf_counter on the CPU."""
    import torch

    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def block(calls: int) -> float:
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end)
    else:

        def block(calls: int) -> float:
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - started) * 1e3

    single = max(block(1), 1e-3)
    calls = max(1, min(1000, math.ceil(min_block_ms / single)))
    return statistics.median(block(calls) / calls for _ in range(repeats))


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream, as capture requires): its replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
