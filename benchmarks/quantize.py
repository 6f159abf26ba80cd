"""2:4 + INT8 / FP8 on MiniLM-L6: nmdeploy quantize against onnxruntime's quantize_static on the same 2:4 model
and the same calibration sentences.

The 2:4 model is the one-shot conversion (``ConvertPass`` defaults: SparseGPT, sequential) of the MiniLM-L6 export
on models/minilm/calibration.txt; every quantizer calibrates on those sentences too. Fidelity: mean cosine of the
sentence embeddings against the dense model on models/minilm/evaluation.txt (the calibration's kind of text) and
on 250 sentences of the standard library's docstrings (another kind), both in ONNX Runtime on the CPU. Pattern
kept: ``inspect``'s 2:4 compliance of every weight behind its DequantizeLinear. INT8 in/out: layers whose input is
read from a DequantizeLinear and whose output (after the epilogue TensorRT fuses) is read by QuantizeLinear nodes
only (``quantized_io``), the condition for TensorRT's sparse INT8 kernels. nvidia-modelopt is not installed here,
so its ONNX quantizer is not in the table. Writes the ``quantize`` section of BENCHMARKS.md.

    python benchmarks/quantize.py [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import numpy as np
from recover import docstring_sentences
from report import machine, write_section

from nmdeploy.conversion.convert import ConvertPass
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.quantize import QuantizePass, quantized_io
from nmdeploy.reference import minilm


def onnxruntime_static(
    source: Path,
    out: Path,
    feeds: list[dict[str, np.ndarray]],
    method: str,
    op_types: list[str] | None,
    symmetric: bool = True,
) -> None:
    """onnxruntime's quantize_static: QDQ, per-channel INT8 weights, INT8 activations, symmetric as TensorRT needs
    them unless ``symmetric`` is False (its default); ``op_types`` None quantizes every op type it supports."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(feeds)

        def get_next(self):
            return next(self.items, None)

    quantize_static(
        str(source),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        op_types_to_quantize=op_types,
        calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy}[method],
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True} if symmetric else {},
    )


def rows_padded(feeds: list[dict[str, np.ndarray]], length: int = 64) -> list[dict[str, np.ndarray]]:
    """One sentence per batch, padded to one token count (padding id 0, mask 0): onnxruntime's entropy calibration
    stacks every batch's values and fails on batches of different shapes."""
    return [
        {name: np.pad(array[row : row + 1], ((0, 0), (0, length - array.shape[1]))) for name, array in feed.items()}
        for feed in feeds
        for row in range(len(next(iter(feed.values()))))
    ]


def ours(source: Path, out: Path, calibration: Path, **options) -> None:
    model = OnnxModel.load(source)
    QuantizePass(calibration=calibration, **options)(model)
    model.save(out)


def pattern_and_io(path: Path) -> tuple[str, str]:
    """TensorRT-eligible weights still 2:4, and their layers that are INT8 in and out (of the eligible ones)."""
    model = OnnxModel.load(path)
    rows = [row for row in inspect_model(model, "2:4").rows if row.eligible]
    kept = sum(row.compliant == 1.0 for row in rows)
    io = quantized_io(model)
    layers = {node for row in rows for node in row.nodes}
    both = sum(quantized_in and quantized_out for node, (quantized_in, quantized_out) in io.items() if node in layers)
    return f"{kept}/{len(rows)}", f"{both}/{len(rows)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmdeploy-quantize-bench-"))
    dense = minilm.export_minilm_onnx(work / "dense.onnx")
    calibration_texts = minilm.sentences("calibration")
    calibration = work / "calib"
    minilm.write_sentence_npz(calibration_texts, calibration)
    calibration_feeds = minilm.sentence_feeds(calibration_texts)
    sparse = work / "2of4.onnx"
    model = OnnxModel.load(dense)
    ConvertPass(calibration=calibration)(model)
    model.save(sparse)
    sets = {
        "same kind": minilm.sentence_feeds(minilm.sentences("evaluation")),
        "other kind": minilm.sentence_feeds(docstring_sentences()),
    }
    reference = {name: minilm.embed_onnx(dense, feeds) for name, feeds in sets.items()}
    variants = {
        "2:4 fp32 (no quantization)": None,
        "nmdeploy INT8 (entropy, --no-smooth)": lambda out: ours(sparse, out, calibration, smooth=False),
        "nmdeploy INT8 (entropy, smoothing 0.85: the default)": lambda out: ours(sparse, out, calibration),
        "nmdeploy INT8 (entropy, --smooth-strength 1)": lambda out: ours(
            sparse, out, calibration, smoothing_strength=1.0
        ),
        "nmdeploy INT8 (entropy, --smooth-strength 1, --quantize-residuals)": lambda out: ours(
            sparse, out, calibration, smoothing_strength=1.0, quantize_residuals=True
        ),
        "nmdeploy FP8 E4M3 (max)": lambda out: ours(sparse, out, calibration, precision="fp8"),
        "nmdeploy FP8 E4M3 (max, --smooth)": lambda out: ours(sparse, out, calibration, precision="fp8", smooth=True),
        "onnxruntime quantize_static INT8, MatMul only (MinMax, symmetric)": lambda out: onnxruntime_static(
            sparse, out, calibration_feeds, "minmax", ["MatMul"]
        ),
        "onnxruntime quantize_static INT8, MatMul only (MinMax, asymmetric activations: its default)": lambda out: (
            onnxruntime_static(sparse, out, calibration_feeds, "minmax", ["MatMul"], symmetric=False)
        ),
        "onnxruntime quantize_static INT8, MatMul only (Entropy, symmetric)": lambda out: onnxruntime_static(
            sparse, out, rows_padded(calibration_feeds), "entropy", ["MatMul"]
        ),
        "onnxruntime quantize_static INT8, its default op types (MinMax)": lambda out: onnxruntime_static(
            sparse, out, calibration_feeds, "minmax", None
        ),
    }
    rows = []
    for label, make in variants.items():
        path = sparse if make is None else work / f"variant-{len(rows)}.onnx"
        start = time.perf_counter()
        try:
            if make is not None:
                make(path)
        except Exception as error:  # an anchor that fails on this model is a result too
            row = f"| {label} | failed: {str(error).splitlines()[0][:80]} | | | | |"
            print(row, flush=True)
            rows.append(row)
            continue
        seconds = time.perf_counter() - start
        cosines = [minilm.mean_cosine(reference[name], minilm.embed_onnx(path, feeds)) for name, feeds in sets.items()]
        kept, io = pattern_and_io(path) if make is not None else ("-", "-")
        timing = f"{seconds:.1f}" if make is not None else "-"
        row = f"| {label} | {cosines[0]:.4f} | {cosines[1]:.4f} | {timing} | {kept} | {io} |"
        print(row, flush=True)
        rows.append(row)
    section = "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}; MiniLM-L6, the one-shot 2:4 conversion, "
            f"{len(calibration_texts)} calibration sentences for every quantizer. Cosine: mean embedding cosine "
            "against the dense model (same kind: models/minilm/evaluation.txt; other kind: 250 sentences of the "
            "standard library's docstrings). 2:4 kept: TensorRT-eligible weights still 2:4 behind their "
            "DequantizeLinear. INT8 in/out: eligible layers whose input and (post-epilogue) output are quantized, "
            "TensorRT's condition for sparse INT8 kernels. nvidia-modelopt's ONNX quantizer: not installed here, "
            "not measured. onnxruntime's default op types quantize Gather, Add, Softmax and the attention MatMuls "
            "too. onnxruntime's MatMul-only Q/DQ also quantizes each MatMul's output, but before its bias Add. "
            "Seconds: the quantizer's own time.",
            "",
            "| variant | cosine, same kind | cosine, other kind | seconds | 2:4 kept | INT8 in/out |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    if args.no_write:
        print(section)
    else:
        write_section("quantize", "## Sparse and quantized (`python benchmarks/quantize.py`)", section)


if __name__ == "__main__":
    main()
