"""``nmdeploy compare REFERENCE CANDIDATE --data DATA``: how far a candidate's outputs are from the reference's."""

from __future__ import annotations

import argparse
import json
import logging

from nmdeploy.cli.options import add_data_option, add_json_option, add_outputs_option
from nmdeploy.evaluation.compare import compare_models, comparison_table

log = logging.getLogger(__name__)

FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", metavar="REFERENCE", help="the reference ONNX model (for example the dense one)")
    parser.add_argument("candidate", metavar="CANDIDATE", help="the ONNX model to compare with it")
    add_data_option(parser, required=True, purpose="inputs both models run on")
    add_outputs_option(parser)
    parser.add_argument(
        "--metric",
        default="cosine",
        metavar="METRIC",
        help="the fidelity figure: cosine (mean over the judged outputs, default), top1 (agreement of class-score "
        "outputs), or MODULE:FUNCTION(reference_outputs, candidate_outputs, feeds) -> float, averaged over batches",
    )
    parser.add_argument(
        "--min-fidelity",
        type=float,
        metavar="F",
        help="PASSED only when the fidelity figure is F or above (exit 1 otherwise); without it the figures are "
        "measured, not judged",
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.fidelity import check_min_fidelity, resolve_metric

    if args.min_fidelity is not None:
        check_min_fidelity(args.min_fidelity)
    if args.data == "random":
        log.warning("comparing on random inputs: fine for a functional check, meaningless for accuracy")
    metric = resolve_metric(args.metric)
    result = compare_models(args.reference, args.candidate, args.data, metric, args.outputs)
    fidelity = result.fidelity
    passed = args.min_fidelity is None or fidelity >= args.min_fidelity
    if args.json:
        print(
            json.dumps(
                {
                    "reference": args.reference,
                    "candidate": args.candidate,
                    "batches": result.batches,
                    "outputs_judged": result.selection.to_json() if result.selection else None,
                    "fidelity": {"metric": args.metric, "value": fidelity, "min_fidelity": args.min_fidelity},
                    "passed": passed if args.min_fidelity is not None else None,
                    "metric": result.metric,
                    "outputs": [o.as_dict() for o in result.outputs],
                },
                indent=2,
            )
        )
        return 0 if passed else FAILED
    print(comparison_table(result.outputs))
    if result.selection is not None:
        print(result.selection.describe())
    figure = f"{args.metric} {fidelity:.6g}"
    if args.min_fidelity is None:
        print(f"measured | {figure} over {result.batches} batches (no --min-fidelity given, nothing judged)")
        return 0
    if passed:
        print(f"PASSED | {figure} >= {args.min_fidelity} over {result.batches} batches")
        return 0
    print(f"FAILED | {figure} < {args.min_fidelity} over {result.batches} batches")
    return FAILED
