"""Experiment (not a feature): each layer's damping chosen on held-out calibration rows, patched into `convert`.

Beside each layer's X^T X the statistics engine keeps the moments B of a held-out fold (the second half of each
piece's rows along the batch, or of its tokens for a one-row piece). Before each fit the damping of ``--grid`` whose
fit on H - B leaves the least output error on B, plus the fit on B judged on H - B, is chosen; the layer is then
fitted on all rows at that damping times ``--scale`` (a ridge relative to the mean of diag(X^T X) scales with the
rows, so the fold's best may be too strong for twice the rows: 0.5 tries that). Layers whose targets are shifted
(the dense-model fit target) and block-diagonal statistics keep the pass's own damping. Each choice is one JSON line
in ``--log``. Figures: BENCHMARKS.md (SmolLM2 damping bullet).

    python benchmarks/held_out_damping.py --scale 1 --log choices.jsonl -- convert dense.onnx -o cv.onnx --calib c.npz
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from nmdeploy.calibration.statistics import engine
from nmdeploy.calibration.statistics.taps import as_matrix
from nmdeploy.cli import main
from nmdeploy.graph.tensors import to_torch
from nmdeploy.masks.fitting import LayerFit
from nmdeploy.passes import convert as convert_pass

GRID = (0.01, 0.03, 0.1, 0.3, 1.0)


def patch(scale: float, grid: tuple[float, ...], log: str) -> None:
    accumulate, convert = engine.accumulate, convert_pass.ConvertPass._convert

    def accumulate_with_fold(stats, tap, values, dense, dense_weights=None):
        accumulate(stats, tap, values, dense, dense_weights)
        hessian = stats[0].hessian
        if not isinstance(hessian, torch.Tensor):
            return
        if len(values) >= 2:
            fold = values[len(values) // 2 :]
        elif values.ndim >= 3:  # one sequence: the second half of its tokens
            fold = values[:, values.shape[1] // 2 :]
        else:
            return  # one row of one vector: nothing to hold out
        held = getattr(hessian, "held_out", None)
        for x in tap.row_chunks(fold, device=hessian.device):
            x = x.to(torch.float64)
            held = x.T @ x if held is None else held + x.T @ x
        hessian.held_out = held  # an attribute of the moments object: it goes when they do

    def output_error(delta: torch.Tensor, moments: torch.Tensor) -> float:
        return float(((delta @ moments) * delta).sum())

    def convert_at_chosen_damping(self, model, weight, stats, shared=False, damping=None):
        held = getattr(getattr(stats, "hessian", None), "held_out", None)
        if held is None or stats.shifted:
            return convert(self, model, weight, stats, shared, damping)
        fitted_on = stats.hessian.to(torch.float64) - held
        dense = as_matrix(weight, to_torch(model.read(weight.tensor)).to(torch.float64))
        errors = {}
        for candidate in grid:
            total = 0.0
            for fit, judge in ((fitted_on, held), (held, fitted_on)):
                layer = LayerFit(dense, dense != 0, fit.to(torch.float32).clone(), self.pattern, candidate)
                total += output_error(self.method.fit(layer).to(torch.float64) - dense, judge)
            errors[candidate] = total
        best = min(errors, key=errors.get)
        with open(log, "a") as out:
            out.write(json.dumps({"weight": weight.name, "k": dense.shape[1], "best": best, "errors": errors}) + "\n")
        return convert(self, model, weight, stats, shared, best * scale)

    engine.accumulate = accumulate_with_fold
    convert_pass.ConvertPass._convert = convert_at_chosen_damping


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--grid", default=",".join(map(str, GRID)))
    parser.add_argument("--log", default="held_out_damping.jsonl")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the nmdeploy command line")
    args = parser.parse_args()
    patch(args.scale, tuple(float(x) for x in args.grid.split(",")), args.log)
    sys.exit(main(args.argv[1:] if args.argv[:1] == ["--"] else args.argv))
