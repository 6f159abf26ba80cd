"""``nmdeploy compare REFERENCE CANDIDATE --data DATA``: how far a candidate's outputs are from the reference's."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import DataArgs, FidelityArgs, OutputsArgs, ReportArgs, add_groups

FAILED = 1
NOT_JUDGED = 2  # a figure the data cannot move (ill-conditioned): not a regression, never PASSED
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
    unjudged = result.unjudged
    value = None if unjudged else result.fidelity
    passed = bar is not None and value is not None and value >= bar
    code = 0 if bar is None or passed else NOT_JUDGED if unjudged else FAILED
    if result.batch_failure is not None:  # a candidate that crashes where the reference runs is never PASSED
        passed, code = False, FAILED
    if REPORT.parse(args).json:
        document = {"reference": args.reference, "candidate": args.candidate, "batches": result.batches}
        document["outputs_judged"] = result.selection.to_json() if result.selection else None
        document["fidelity"] = {"metric": fidelity.spec, "value": value, "min_fidelity": bar}
        document["judged"] = [figure.to_json() for figure in result.figures]
        document |= {"passed": passed if bar is not None or result.batch_failure else None, "metric": result.metric}
        document["batch_failure"] = result.batch_failure
        print(json.dumps(document | {"outputs": [o.as_dict() for o in result.outputs]}, indent=2))
        return code
    print(comparison_table(result.outputs, figures=result.figures))
    if result.selection is not None:
        print(result.selection.describe())
    for figure in result.figures:
        print("  " + figure.describe())
    batches = f"over {result.batches} batches"
    if result.batch_failure is not None:
        print(f"FAILED | {result.batch_failure}")
        return code
    if unjudged:
        what = "; ".join(f"'{f.output}': {f.metric} cannot judge it here: {f.problem}" for f in unjudged)
        print(f"{'NOT JUDGED' if bar is not None else 'measured'} | {what}")
        return code
    from nmdeploy.fidelity import metric_label

    # auto names what it judged by, another measure what judged the outputs it does not apply to ("perplexity/cosine")
    label = (
        metric_label(fidelity.metric, result.selection, result.figures) if isinstance(fidelity.metric, str) else None
    )
    figure = f"{fidelity.spec}{f' ({label})' if label and label != fidelity.spec else ''} {value:.6g}"
    if bar is None:
        print(f"measured | {figure} {batches} (no --min-fidelity given, nothing judged)")
        return 0
    if passed:
        print(f"PASSED | {figure} >= {bar} {batches}")
        return 0
    print(f"FAILED | {figure} < {bar} {batches}")
    return FAILED
