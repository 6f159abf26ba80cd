"""``nmdeploy compare REFERENCE CANDIDATE --data DATA``: how far a candidate's outputs are from the reference's."""

from __future__ import annotations

import argparse
import json
import logging

from nmdeploy.cli.options import add_data_option, add_json_option
from nmdeploy.evaluation.compare import compare_models, comparison_table
from nmdeploy.fidelity import load_metric

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", metavar="REFERENCE", help="the reference ONNX model (for example the dense one)")
    parser.add_argument("candidate", metavar="CANDIDATE", help="the ONNX model to compare with it")
    add_data_option(parser, required=True, purpose="inputs both models run on")
    parser.add_argument(
        "--metric",
        metavar="MODULE:FUNCTION",
        help="also report FUNCTION(reference_outputs, candidate_outputs, feeds), averaged over batches",
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    if args.data == "random":
        log.warning("comparing on random inputs: fine for a functional check, meaningless for accuracy")
    metric = load_metric(args.metric) if args.metric else None
    result = compare_models(args.reference, args.candidate, args.data, metric)
    if args.json:
        print(
            json.dumps(
                {
                    "reference": args.reference,
                    "candidate": args.candidate,
                    "batches": result.batches,
                    "metric": result.metric,
                    "outputs": [o.as_dict() for o in result.outputs],
                },
                indent=2,
            )
        )
        return 0
    print(comparison_table(result.outputs))
    if result.metric is not None:
        print(f"metric {args.metric}: {result.metric:.6g}")
    print(f"PASSED | compared {result.batches} batches")
    return 0

