"""``nmdeploy compare REFERENCE CANDIDATE --data DATA``: how far a candidate's outputs are from the reference's."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import DataArgs, FidelityArgs, OutputsArgs, ReportArgs, add_groups

FAILED = 1
DATA, OUTPUTS = DataArgs(required=True, purpose="inputs both models run on"), OutputsArgs()
FIDELITY, REPORT = FidelityArgs("compare"), ReportArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", metavar="REFERENCE", help="the reference ONNX model (for example the dense one)")
    parser.add_argument("candidate", metavar="CANDIDATE", help="the ONNX model to compare with it")
    add_groups(parser, DATA, OUTPUTS, FIDELITY, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.evaluation.compare import compare_models, comparison_table

    fidelity = FIDELITY.parse(args)
    bar = fidelity.min_fidelity
    result = compare_models(args.reference, args.candidate, DATA.parse(args), fidelity.metric, OUTPUTS.parse(args))
    passed = bar is None or result.fidelity >= bar
    if REPORT.parse(args).json:
        document = {"reference": args.reference, "candidate": args.candidate, "batches": result.batches}
        document["outputs_judged"] = result.selection.to_json() if result.selection else None
        document["fidelity"] = {"metric": fidelity.spec, "value": result.fidelity, "min_fidelity": bar}
        document |= {"passed": passed if bar is not None else None, "metric": result.metric}
        print(json.dumps(document | {"outputs": [o.as_dict() for o in result.outputs]}, indent=2))
        return 0 if passed else FAILED
    print(comparison_table(result.outputs))
    if result.selection is not None:
        print(result.selection.describe())
    figure = f"{fidelity.spec} {result.fidelity:.6g}"
    if bar is None:
        print(f"measured | {figure} over {result.batches} batches (no --min-fidelity given, nothing judged)")
        return 0
    if passed:
        print(f"PASSED | {figure} >= {bar} over {result.batches} batches")
        return 0
    print(f"FAILED | {figure} < {bar} over {result.batches} batches")
    return FAILED
