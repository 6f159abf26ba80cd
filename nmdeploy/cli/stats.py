"""``nmdeploy stats [WEIGHTS]``: N:M mask statistics of a model's weights."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from nmdeploy.cli.args import PatternArgs, ReportArgs, SelectionArgs, add_groups
from nmdeploy.tables import render_table

PATTERN, SELECTION, REPORT = PatternArgs(), SelectionArgs(names_only=True), ReportArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "weights",
        nargs="?",
        metavar="WEIGHTS",
        help="a .safetensors file or torch state dict (default: the bundled pretrained all-MiniLM-L6-v2)",
    )
    add_groups(parser, PATTERN, SELECTION, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.statistics import default_weights_path, load_weights, mask_statistics, summarize

    path = args.weights or default_weights_path()
    pattern = PATTERN.parse(args).pattern
    stats = mask_statistics(load_weights(path), pattern, SELECTION.parse(args).include)
    summary = summarize(stats)
    if REPORT.parse(args).json:
        document = {"model": str(path), "pattern": str(pattern), "summary": summary}
        print(json.dumps(document | {"weights": [asdict(s) for s in stats]}, indent=2))
        return 0
    print(f"{path}  pattern {pattern}  (retained = fraction of |w| kept; reduction axis 1)")
    columns = ("weight", "shape", "compliant", "1-D", "transp.", "greedy", "skipped")
    rows = [
        (s.name, "x".join(map(str, s.shape)), None, None, None, None, s.skipped)
        if s.skipped
        else (
            s.name,
            "x".join(map(str, s.shape)),
            f"{s.compliant:.3f}",
            f"{s.retained_nm:.4f}",
            _fmt(s.retained_transposable),
            _fmt(s.retained_greedy),
            "",
        )
        for s in stats
    ]
    print(render_table(columns, rows, right=columns[1:6]))
    print(
        f"{summary['weights']} weights, {summary['parameters']:,} parameters: compliant {summary['compliant']:.3f}, "
        f"retained 1-D {summary['retained_nm']:.4f}, transposable {_fmt(summary['retained_transposable'])} "
        f"(greedy {_fmt(summary['retained_greedy'])})"
    )
    return 0


def _fmt(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"
