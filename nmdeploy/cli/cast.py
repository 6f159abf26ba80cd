"""``nmdeploy cast MODEL -o OUT --precision fp16|bf16``: weights and compute to fp16/bf16 for strongly typed engines."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from nmdeploy.cli.args import DataArgs, FidelityArgs, OutputArgs, OutputsArgs, PrecisionArgs, ReportArgs, add_groups

FAILED = 1
NOT_JUDGED = 2  # an output no figure can judge on this data: never PASSED
OUTPUT, PRECISION, OUTPUTS, REPORT = (
    OutputArgs(in_place=True),
    PrecisionArgs(quantized=False),
    OutputsArgs(),
    ReportArgs(),
)
CHECK = DataArgs(
    default="random", purpose="inputs for the accuracy check against MODEL (default: random)", no_check=True
)
MIN_COSINE = FidelityArgs("cast")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the fp32 ONNX model (never modified unless --in-place)")
    add_groups(parser, OUTPUT, PRECISION, CHECK, OUTPUTS, MIN_COSINE, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.evaluation.compare import comparison_table
    from nmdeploy.evaluation.precision import cast_model_file

    bar = MIN_COSINE.parse(args).min_fidelity
    output = OUTPUT.parse(args)
    data = CHECK.parse(args)
    outcome = cast_model_file(args.model, output, data=data, outputs=OUTPUTS.parse(args), **PRECISION.parse(args))
    nodes = [row for row in outcome.report if row.item == "node"]
    tensors = [row for row in outcome.report if row.item == "tensor"]
    comparison = outcome.comparison
    # Each output by its cosine where a cosine can judge it, else across the batch (one value per row: cosine is 1);
    # a figure that cannot judge the data comes first.
    figures = [o.auto_figure() for o in comparison.outputs] if comparison else []
    lowest = min(figures, key=lambda f: (f.problem is None, f.value), default=None)
    passed = lowest is None or (not lowest.problem and lowest.value >= bar)
    if REPORT.parse(args).json:
        document = {"model": args.model, "output": str(outcome.output), "precision": outcome.precision}
        document |= {"modified": outcome.modified, "data": data, "checked_upcast": outcome.upcast_reason}
        document |= {"min_cosine": None if data is None else bar, "passed": None if data is None else passed}
        document |= {"outputs": [o.as_dict() for o in comparison.outputs] if comparison else None}
        document |= {"judged": [figure.to_json() for figure in figures]}
        print(json.dumps(document | {"report": [row.to_json() for row in outcome.report]}, indent=2))
        return 0 if passed else NOT_JUDGED if lowest.problem else FAILED
    kept = [row for row in nodes if row.precision == "fp32"]
    casts = sum(row.item == "cast" for row in outcome.report)
    print(f"{len(nodes) - len(kept)} nodes in {outcome.precision}, {len(kept)} kept in fp32, {casts} casts added")
    for reason, count in sorted(Counter(f"{row.op_type} ({row.reason})" for row in kept).items()):
        print(f"  fp32: {count} x {reason}")
    clamped, raised = sum(row.clamped for row in tensors), sum(row.raised_from_zero for row in tensors)
    print(f"{len(tensors)} stored tensors converted; {clamped} values clamped to the largest finite value, {raised} "
          f"tiny values kept nonzero")  # fmt: skip
    if comparison is not None:
        if outcome.upcast_reason:
            print(f"note: checked the model upcast to fp32 with every {outcome.precision} value rounded, because "
                  f"{outcome.upcast_reason}")  # fmt: skip
        print(comparison_table(comparison.outputs, samples=False))
    if lowest is None:
        print(f"written | cast to {outcome.precision}, accuracy not checked (--no-check) -> {outcome.output}")
        return 0
    if lowest.problem:
        print(f"NOT JUDGED | cast to {outcome.precision}: '{lowest.output}': {lowest.problem} -> {outcome.output}")
        return NOT_JUDGED
    figure = f"{lowest.metric} to fp32 {lowest.value:{'.8g' if not passed else '.5f'}}"
    print(f"{'PASSED' if passed else 'FAILED'} | cast to {outcome.precision}{': ' if not passed else ', '}{figure} "
          f"{'<' if not passed else '>='} {bar} -> {outcome.output}")  # fmt: skip
    return 0 if passed else FAILED
