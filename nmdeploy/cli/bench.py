"""``nmdeploy bench MODEL [MODEL2 ...]``: latency percentiles and throughput per batch size, and A/B ratios."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import (
    BatchArgs,
    BatchAxisArgs,
    DataArgs,
    DeviceArgs,
    ReportArgs,
    ShapesArgs,
    TimingArgs,
    add_groups,
)

TIMING, DEVICE, REPORT = TimingArgs(), DeviceArgs("bench"), ReportArgs()
BATCH = BatchArgs(metavar="1,8,32", help="batch sizes (default: the model's, or 1)")
SHAPES = ShapesArgs(purpose="input shapes for dynamic dimensions other than the batch")
DATA = DataArgs(purpose="real inputs instead of random ones (rows repeated to each batch size)")
AXES = BatchAxisArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "models", nargs="+", metavar="MODEL", help="the model to time; with more, the first is the reference (dense)"
    )
    add_groups(parser, TIMING, DEVICE, BATCH, SHAPES, DATA, AXES, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.cli.views import bench_report
    from nmdeploy.evaluation.bench import benchmark

    timing, report = TIMING.parse(args), REPORT.parse(args)
    result = benchmark(
        args.models,
        backend=timing.backend,
        batches=BATCH.parse(args),
        warmup=timing.warmup,
        iterations=timing.iterations,
        duration=timing.duration,
        shapes=SHAPES.parse(args),
        data=DATA.parse(args),
        device=DEVICE.parse(args),
        progress=report.progress,
        batch_axes=AXES.parse(args),
    )
    print(json.dumps(result.as_dict(), indent=2) if report.json else bench_report(result))
    return 0
