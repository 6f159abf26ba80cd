"""The per-layer precision-and-sparsity budget on MiniLM-L6: each encoder layer 2:4 + INT8, dense INT8, 2:4 fp16 or
dense fp16 within a held-out fidelity floor, beside the uniform choices on the same calibration sentences.

The dense MiniLM-L6 export; calibration models/minilm/calibration.txt (its one seeded split: the budget measures on
the held-out fifth). Fidelity: mean cosine of the sentence embeddings against the dense model on
models/minilm/evaluation.txt (the calibration's kind of text) and on 250 sentences of the standard library's
docstrings (another kind), in ONNX Runtime on the CPU. Expected speed-up: the budget's table (SPEED_UPS in
nmdeploy/conversion/precision_budget.py), weighted by each layer's share of the multiply-adds; not a measurement.
Writes the ``precision-budget`` section of BENCHMARKS.md.

    python benchmarks/precision_budget.py [--floor F ...] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from collections import Counter
from pathlib import Path

from recover import docstring_sentences
from report import machine, write_section

from nmdeploy.conversion.controller import Conversion, ConversionOptions
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.passes.quantize import QuantizePass
from nmdeploy.reference import minilm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=float, nargs="+", default=[0.95], help="held-out cosine floors to budget for")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmdeploy-precision-budget-bench-"))
    dense = minilm.export_minilm_onnx(work / "dense.onnx")
    calibration = work / "calib"
    minilm.write_sentence_npz(minilm.sentences("calibration"), calibration)
    sets = {
        "same kind": minilm.sentence_feeds(minilm.sentences("evaluation")),
        "other kind": minilm.sentence_feeds(docstring_sentences()),
    }
    reference = {name: minilm.embed_onnx(dense, feeds) for name, feeds in sets.items()}

    def cosines(path: Path) -> str:
        values = [minilm.mean_cosine(reference[name], minilm.embed_onnx(path, feeds)) for name, feeds in sets.items()]
        return " | ".join(f"{value:.4f}" for value in values)

    rows = []
    sparse = work / "2of4.onnx"
    model = OnnxModel.load(dense)
    start = time.perf_counter()
    ConvertPass(calibration=calibration, include="encoder")(model)
    model.save(sparse)
    rows.append(
        f"| every layer 2:4 fp32 (one-shot) | {cosines(sparse)} | - | 36 x 2:4 | {time.perf_counter() - start:.0f} |"
    )
    print(rows[-1], flush=True)
    quantized = work / "2of4-int8.onnx"
    start = time.perf_counter()
    QuantizePass(calibration=calibration)(model)
    model.save(quantized)
    seconds = time.perf_counter() - start
    rows.append(
        f"| every layer 2:4 + INT8 (quantize's defaults) | {cosines(quantized)} | - | 36 x 2:4 + INT8 | {seconds:.0f} |"
    )
    print(rows[-1], flush=True)
    for floor in args.floor:
        model = OnnxModel.load(dense)
        start = time.perf_counter()
        options = ConversionOptions(calibration=calibration, include="encoder", min_fidelity=floor, precision="int8")
        report = Conversion(options)(model).report[-1]
        seconds = time.perf_counter() - start
        path = model.save(work / f"budget-{floor}.onnx")
        counts = Counter(layer.choice for layer in report.layers)
        mix = ", ".join(f"{count} x {choice}" for choice, count in counts.most_common())
        rows.append(
            f"| budget, --min-fidelity {floor} (held-out {report.fidelity:.4f}; expected "
            f"{report.expected_speed_up:.2f}x) | {cosines(path)} | {report.fidelity:.4f} | {mix} | {seconds:.0f} |"
        )
        print(rows[-1], flush=True)
        for layer in report.layers:
            print(f"    {layer.node}: {layer.choice}; {layer.reason}", flush=True)
    section = "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}; MiniLM-L6's 36 encoder layers, "
            "models/minilm/calibration.txt for every step (the budget measures on its held-out fifth). Cosine: mean "
            "embedding cosine against the dense model (same kind: models/minilm/evaluation.txt; other kind: 250 "
            "sentences of the standard library's docstrings). Expected speed-up: the budget's table over dense fp16, "
            "weighted by multiply-adds, not measured (no TensorRT here). Seconds: on cores shared with other work.",
            "",
            "| choice | cosine, same kind | cosine, other kind | held-out cosine | layers | seconds |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    if args.no_write:
        print(section)
    else:
        write_section(
            "precision-budget", "## Precision and sparsity budget (`benchmarks/precision_budget.py`)", section
        )


if __name__ == "__main__":
    main()
