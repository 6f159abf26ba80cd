"""``nmdeploy cast MODEL -o OUT --precision fp16|bf16``: weights and compute to fp16/bf16 for strongly typed engines."""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter

from nmdeploy.cli.options import (
    add_data_option,
    add_json_option,
    add_output_options,
    add_outputs_option,
    check_output,
)
from nmdeploy.evaluation.compare import comparison_table
from nmdeploy.evaluation.precision import cast_model_file
from nmdeploy.passes.cast import DEFAULT_KEEP_OPS, PRECISIONS

log = logging.getLogger(__name__)

DEFAULT_MIN_COSINE = 0.99
FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the fp32 ONNX model (never modified unless --in-place)")
    add_output_options(parser)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp16", help="target type (default fp16)")
    parser.add_argument(
        "--keep-ops",
        metavar="OP,OP",
        type=lambda text: [op.strip() for op in text.split(",") if op.strip()],
        help=f"op types that stay fp32, replacing the default list ({', '.join(sorted(DEFAULT_KEEP_OPS))})",
    )
    parser.add_argument("--keep-nodes", metavar="REGEX", help="nodes whose name matches also stay fp32")
    parser.add_argument(
        "--cast-io", action="store_true", help="give the model fp16/bf16 inputs and outputs (default: they stay fp32)"
    )
    check = parser.add_mutually_exclusive_group()
    add_data_option(check, default="random", purpose="inputs for the accuracy check against MODEL (default: random)")
    check.add_argument("--no-check", action="store_true", help="skip the accuracy check")
    add_outputs_option(parser)
    parser.add_argument(
        "--min-cosine",
        type=float,
        default=DEFAULT_MIN_COSINE,
        metavar="F",
        help="FAILED (exit 1; the model is still written, to look at) when a judged output's mean cosine to MODEL "
        "is below F (default %(default)g: fp16/bf16 rounding alone stays far above it)",
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.fidelity import check_min_fidelity

    check_min_fidelity(args.min_cosine, "--min-cosine")
    check_output(args.model, args.output, args.in_place)
    outcome = cast_model_file(
        args.model,
        args.output,
        precision=args.precision,
        keep_ops=args.keep_ops,
        keep_nodes=args.keep_nodes,
        keep_io=not args.cast_io,
        data=None if args.no_check else args.data,
        outputs=args.outputs,
    )
    nodes = [row for row in outcome.report if row.item == "node"]
    tensors = [row for row in outcome.report if row.item == "tensor"]
    casts = [row for row in outcome.report if row.item == "cast"]
    comparison = outcome.comparison
    worst = min((o.mean_cosine for o in comparison.outputs), default=1.0) if comparison else None
    passed = worst is None or worst >= args.min_cosine
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "output": str(outcome.output),
                    "precision": outcome.precision,
                    "modified": outcome.modified,
                    "data": None if args.no_check else args.data,
                    "checked_upcast": outcome.upcast_reason,
                    "min_cosine": None if args.no_check else args.min_cosine,
                    "passed": None if args.no_check else passed,
                    "outputs": [o.as_dict() for o in comparison.outputs] if comparison else None,
                    "report": [row.to_json() for row in outcome.report],
                },
                indent=2,
            )
        )
        return 0 if passed else FAILED
    kept = [row for row in nodes if row.precision == "fp32"]
    reasons = Counter(f"{row.op_type} ({row.reason})" for row in kept)
    print(f"{len(nodes) - len(kept)} nodes in {outcome.precision}, {len(kept)} kept in fp32, {len(casts)} casts added")
    for reason, count in sorted(reasons.items()):
        print(f"  fp32: {count} x {reason}")
    clamped = sum(row.clamped for row in tensors)
    raised = sum(row.raised_from_zero for row in tensors)
    print(f"{len(tensors)} stored tensors converted; {clamped} values clamped to the largest finite value, {raised} "
          f"tiny values kept nonzero")  # fmt: skip
    if comparison is not None:
        if args.data == "random":
            log.warning("checked on random inputs: fine for a functional check, meaningless for accuracy")
        if outcome.upcast_reason:
            print(f"note: checked the model upcast to fp32 with every {outcome.precision} value rounded, because "
                  f"{outcome.upcast_reason}")  # fmt: skip
        print(comparison_table(comparison.outputs, samples=False))
    if worst is None:
        print(f"written | cast to {outcome.precision}, accuracy not checked (--no-check) -> {outcome.output}")
        return 0
    if not passed:
        print(
            f"FAILED | cast to {outcome.precision}: cosine to fp32 {worst:.8g} < {args.min_cosine} -> {outcome.output}"
        )
        return FAILED
    print(f"PASSED | cast to {outcome.precision}, cosine to fp32 {worst:.5f} >= {args.min_cosine} -> {outcome.output}")
    return 0
