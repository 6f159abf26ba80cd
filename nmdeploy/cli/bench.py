"""``nmdeploy bench MODEL [MODEL2 ...]``: latency percentiles and throughput per batch size, and A/B ratios."""

from __future__ import annotations

import argparse
import json
import sys

from nmdeploy.cli.options import add_data_option, add_json_option, add_shapes_option, parsed_shapes
from nmdeploy.evaluation.bench import BACKENDS, BenchReport, benchmark, parse_batches
from nmdeploy.tables import render_table

RATIO_COLUMNS = ("batch", "p50 ratio", "p90 ratio", "mean ratio")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "models", nargs="+", metavar="MODEL", help="the model to time; with more, the first is the reference (dense)"
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default="ort", help="runtime (default: ort, ONNX Runtime on CPU)"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="torch backend only: auto (CUDA when present), cpu (dense only) or cuda (2:4 kernels)",
    )
    parser.add_argument("--batch", default=None, metavar="1,8,32", help="batch sizes (default: the model's, or 1)")
    add_shapes_option(parser, purpose="input shapes for dynamic dimensions other than the batch")
    add_data_option(parser, purpose="real inputs instead of random ones (rows repeated to each batch size)")
    parser.add_argument("--warmup", type=int, default=10, metavar="N", help="untimed runs per model first (10)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--iterations", type=int, metavar="N", help="timed runs per model and batch size (100)")
    budget.add_argument("--seconds", type=float, metavar="S", help="time budget per batch size instead of a count")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    report = benchmark(
        args.models,
        backend=args.backend,
        batches=parse_batches(args.batch) if args.batch else None,
        warmup=args.warmup,
        iterations=args.iterations,
        seconds=args.seconds,
        shapes=parsed_shapes(args),
        data=args.data,
        device=args.device,
        progress=not args.json and sys.stderr.isatty(),
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    print(format_report(report))
    return 0


def format_report(report: BenchReport) -> str:
    columns = ("model", "batch", "p50 ms", "p90 ms", "p99 ms", "samples/s", "runs")
    rows = [
        (
            model,
            batch,
            f"{latency.p50_ms:.3f}",
            f"{latency.p90_ms:.3f}",
            f"{latency.p99_ms:.3f}",
            f"{latency.throughput:.1f}",
            latency.runs,
        )
        for batch, stats in report.latencies.items()
        for model, latency in zip(report.models, stats, strict=True)
    ]
    lines = [render_table(columns, rows, right=columns[1:]), *report.notes]
    for batch, shapes in report.input_shapes.items():
        given = ", ".join(f"{name} {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in shapes.items())
        lines.append(f"inputs at batch {batch}: {given}")
    lines.append(report.threads)
    summary = f"{len(report.models)} model(s) x {len(report.latencies)} batch size(s) on {report.backend}"
    for candidate in report.models[1:]:
        lines.append(f"{candidate} / {report.models[0]} (interleaved in one run; below 1 is faster):")
        ratios = [
            (ratio.batch, f"{ratio.p50:.3f}", f"{ratio.p90:.3f}", f"{ratio.mean:.3f}")
            for ratio in report.ratios
            if ratio.candidate == candidate
        ]
        lines.append(render_table(RATIO_COLUMNS, ratios, right=RATIO_COLUMNS))
        summary += f", p50 ratio {candidate}/{report.models[0]} {report.p50_ratio_geomean(candidate):.3f} (geomean)"
    lines.append(report.sparse_kernels)
    lines.append(f"measured | bench {summary} (nothing judged: nmdeploy regress judges latency ratios)")
    return "\n".join(lines)
