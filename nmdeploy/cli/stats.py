"""``nmdeploy stats [WEIGHTS]``: N:M mask statistics of a model's weights."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from nmdeploy.cli.options import add_json_option, add_pattern_option
from nmdeploy.statistics import default_weights_path, load_weights, mask_statistics, summarize
from nmdeploy.tables import render_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "weights",
        nargs="?",
        metavar="WEIGHTS",
        help="a .safetensors file or torch state dict (default: the bundled pretrained all-MiniLM-L6-v2)",
    )
    add_pattern_option(parser)
    parser.add_argument("--include", metavar="REGEX", help="only weights whose name matches this regular expression")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    path = args.weights or default_weights_path()
    stats = mask_statistics(load_weights(path), args.pattern, args.include)
    summary = summarize(stats)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(path),
                    "pattern": str(args.pattern),
                    "summary": summary,
                    "weights": [asdict(s) for s in stats],
                },
                indent=2,
            )
        )
        return 0
    print(f"{path}  pattern {args.pattern}  (retained = fraction of |w| kept; reduction axis 1)")
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
