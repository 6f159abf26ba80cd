"""``convert --min-fidelity F --precision int8|fp8 [--recover]``: what the per-layer precision-and-sparsity budget
chose, and what recovery did, shown."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from nmdeploy.cli.args.weights import left_dense
from nmdeploy.cli.views import held_out_fidelity, recovery_line
from nmdeploy.tables import render_table

if TYPE_CHECKING:
    from pathlib import Path

    from nmdeploy.conversion.precision_budget_report import PrecisionBudgetReport
    from nmdeploy.graph.model import OnnxModel


def show_precision_budget(
    model: OnnxModel, path: Path, report: PrecisionBudgetReport, args: argparse.Namespace, as_json: bool
) -> int:
    """Each layer's choice and the outcome of the written Q/DQ ``model`` (at ``path``); ``--require`` judges it as
    plain ``convert`` does: exit 1 when a TensorRT-eligible weight is left dense."""
    chose = {row.weight: f"the budget chose {row.choice}" for row in report.layers if not row.choice.startswith("2:4")}
    dense = left_dense(model, args, chose, "not converted")
    if as_json:
        document = {"model": str(model.path), "output": str(path), "budget": report.to_json(), **dense.to_json()}
        print(json.dumps(document, indent=2))
        return dense.exit_code
    rows = [(layer.node, layer.choice, f"{layer.speed_ups.get(layer.choice, 1.0):.2f}x", layer.reason)
            for layer in report.layers]  # fmt: skip
    print(render_table(("layer", "choice", "expected speed-up", "reason"), rows))
    if report.recovery is not None:  # judged by the interpreter on the floating-point mix; the line below, in ORT
        print(recovery_line(report.recovery, " of the 2:4 layers, before quantization"))
    counts: dict[str, int] = {}
    for layer in report.layers:
        counts[layer.choice] = counts.get(layer.choice, 0) + 1
    mix = ", ".join(f"{count} x {choice}" for choice, count in sorted(counts.items(), key=lambda item: -item[1]))
    outcome = f"{held_out_fidelity(report)}; {mix}; expected speed-up {report.expected_speed_up:.2f}x over dense fp16"
    print(dense.final_line(outcome, path))
    return dense.exit_code
