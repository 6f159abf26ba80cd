"""2:4 + INT8 / FP8 on MiniLM-L6, the digits CNN and the PP-OCR text detector: nmdeploy quantize against
onnxruntime's quantize_static and ModelOpt's ONNX quantizer on the same 2:4 model and the same calibration data.

Each 2:4 model is the one-shot conversion (``ConvertPass`` defaults: SparseGPT, sequential) of the dense model on its
calibration data, and every quantizer calibrates on that data too. Fidelity, in ONNX Runtime on the CPU: MiniLM's
mean embedding cosine against the dense model on models/minilm/evaluation.txt (the calibration's kind of text) and
on 250 sentences of the standard library's docstrings (another kind); the digits CNN's top-1 accuracy on its 450
held-out test images; the detector's text-mask IoU against the dense model on rendered printed text (calibrated on
photo crops and digit pages). Pattern kept: ``inspect``'s 2:4 compliance of every TensorRT-eligible weight behind its
DequantizeLinear. 8-bit in/out: eligible layers whose input is read from a DequantizeLinear and whose output (after
the epilogue TensorRT fuses) is read by QuantizeLinear nodes only (``quantized_io``), the condition for TensorRT's
sparse INT8 kernels. ModelOpt (nvidia-modelopt, with its ONNX extras) is looked for on ``--modelopt-site`` folders
(``pip install --target`` folders, put on the path of the interpreter ModelOpt runs in); where it does not import,
its rows say so.
Writes the ``quantize`` section of BENCHMARKS.md.

    PYTHONPATH=. python benchmarks/quantize.py [--no-write] [--models minilm,digits,detector] [--modelopt-site DIR ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from recover import docstring_sentences
from report import machine, write_section

from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
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


# ModelOpt patches onnxruntime.quantization's modules when it quantizes, which breaks onnxruntime's own
# quantize_static in the same interpreter afterwards: it runs in an interpreter of its own, with the sites on its path.
MODELOPT_PROBE = "import modelopt, modelopt.onnx.quantization; print(modelopt.__version__)"
MODELOPT_INT8 = """
import sys
import numpy as np
from modelopt.onnx.quantization import quantize

source, out, data = sys.argv[1:4]
with np.load(data) as arrays:
    calibration = {name: arrays[name] for name in arrays.files}
quantize(
    source,
    quantize_mode="int8",
    calibration_data=calibration,
    calibration_eps=["cpu"],
    high_precision_dtype="fp32",
    output_path=out,
    log_level="ERROR",
)
"""


def modelopt_run(sites: list[str], code: str, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*sites, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    environment = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=environment)


def modelopt_version(sites: list[str]) -> str | None:
    """ModelOpt's version where it and its ONNX extras import from the ``sites`` folders, else None."""
    probe = modelopt_run(sites, MODELOPT_PROBE)
    return probe.stdout.strip() if probe.returncode == 0 else None


def modelopt_int8(sites: list[str], source: Path, out: Path, feeds: list[dict[str, np.ndarray]]) -> None:
    """ModelOpt's ONNX PTQ, INT8, its default method and op types, calibrated on the CPU execution provider; the
    rest of the graph stays fp32 (its default would cast it to fp16, which ONNX Runtime on the CPU runs slowly)."""
    data = out.with_suffix(".calibration.npz")
    np.savez(data, **{name: np.concatenate([feed[name] for feed in feeds]) for name in feeds[0]})
    result = modelopt_run(sites, MODELOPT_INT8, str(source), str(out), str(data))
    if result.returncode != 0:
        raise RuntimeError((result.stderr.strip().splitlines() or ["no message"])[-1])


def pattern_and_io(path: Path) -> tuple[str, str]:
    """TensorRT-eligible weights still 2:4, and their layers that are 8-bit in and out (of the eligible ones)."""
    model = OnnxModel.load(path)
    rows = [row for row in inspect_model(model, "2:4").rows if row.eligible]
    kept = sum(row.compliant == 1.0 for row in rows)
    io = quantized_io(model)
    layers = {node for row in rows for node in row.nodes}
    both = sum(quantized_in and quantized_out for node, (quantized_in, quantized_out) in io.items() if node in layers)
    return f"{kept}/{len(rows)}", f"{both}/{len(rows)}"


@dataclass
class Case:
    """One model: its 2:4 conversion, its calibration (folder and feeds), how to measure fidelity, the variants."""

    title: str
    sparse: Path
    calibration: Path
    calibration_feeds: list[dict[str, np.ndarray]]
    measures: tuple[str, ...]
    measure: Callable[[Path], list[float]]
    note: str
    op_types: list[str]
    variants: dict[str, Callable[[Path], None] | None] = field(default_factory=dict)


def convert_one_shot(dense: Path, calibration: Path, out: Path) -> Path:
    model = OnnxModel.load(dense)
    ConvertPass(calibration=calibration)(model)
    model.save(out)
    return out


def minilm_case(work: Path) -> Case:
    dense = minilm.export_minilm_onnx(work / "minilm-dense.onnx")
    texts = minilm.sentences("calibration")
    calibration = work / "minilm-calib"
    minilm.write_sentence_npz(texts, calibration)
    sets = {
        "same kind": minilm.sentence_feeds(minilm.sentences("evaluation")),
        "other kind": minilm.sentence_feeds(docstring_sentences()),
    }
    reference = {name: minilm.embed_onnx(dense, feeds) for name, feeds in sets.items()}

    def measure(path: Path) -> list[float]:
        return [minilm.mean_cosine(reference[name], minilm.embed_onnx(path, feeds)) for name, feeds in sets.items()]

    return Case(
        "MiniLM-L6",
        convert_one_shot(dense, calibration, work / "minilm-2of4.onnx"),
        calibration,
        minilm.sentence_feeds(texts),
        ("cosine, same kind", "cosine, other kind"),
        measure,
        f"{len(texts)} calibration sentences; mean embedding cosine against the dense model (same kind: "
        "models/minilm/evaluation.txt; other kind: 250 sentences of the standard library's docstrings)",
        ["MatMul"],
    )


def digits_case(work: Path) -> Case:
    from nmdeploy.pipeline.models import prepare_digits
    from nmdeploy.pipeline.steps import labelled_accuracy

    prepared = prepare_digits(work / "digits")
    inputs, labels = prepared.labelled
    images = np.concatenate([np.load(path)["image"] for path in sorted(prepared.calibration.glob("*.npz"))])
    dense_accuracy = labelled_accuracy(prepared.dense, inputs, labels)
    return Case(
        "digits CNN",
        convert_one_shot(prepared.dense, prepared.calibration, work / "digits-2of4.onnx"),
        prepared.calibration,
        [{"image": images[start : start + 64]} for start in range(0, len(images), 64)],
        ("top-1 %",),
        lambda path: [100 * labelled_accuracy(path, inputs, labels)],
        f"{len(images)} calibration images; top-1 accuracy on the {len(labels)} held-out test images (dense "
        f"{100 * dense_accuracy:.2f} %); bar: within 0.3 points of 2:4 fp32",
        ["Conv", "Gemm", "MatMul"],
    )


def detector_case(work: Path) -> Case:
    from nmdeploy.reference import textdet

    images = textdet.calibration_images()
    calibration = work / "textdet-calib"
    textdet.write_image_npz(images, calibration)
    evaluation = textdet.image_feeds(textdet.evaluation_images())
    dense = textdet.model_path()
    reference = textdet.detect_onnx(dense, evaluation)
    return Case(
        "PP-OCRv6 text detector",
        convert_one_shot(dense, calibration, work / "textdet-2of4.onnx"),
        calibration,
        textdet.image_feeds(images),
        ("mask IoU",),
        lambda path: [textdet.mask_iou(reference, textdet.detect_onnx(path, evaluation))],
        f"{len(images)} calibration images {images.shape[1]}x{images.shape[2]} (photo crops, digit pages); "
        "text-mask IoU against the dense model on rendered printed text; bar: within 0.02 of 2:4 fp32",
        ["Conv", "Gemm", "MatMul"],
    )


CASES: dict[str, Callable[[Path], Case]] = {"minilm": minilm_case, "digits": digits_case, "detector": detector_case}


def add_variants(case: Case, modelopt_sites: list[str], modelopt: str | None) -> None:
    sparse, calibration, feeds = case.sparse, case.calibration, case.calibration_feeds
    variants: dict[str, Callable[[Path], None] | None] = {"2:4 fp32 (no quantization)": None}
    if case.title == "MiniLM-L6":
        variants.update(
            {
                "nmdeploy INT8 (the default: auto ranges, smoothing 0.85, lossy outputs rescaled)": lambda out: ours(
                    sparse, out, calibration
                ),
                "nmdeploy INT8 (lossy outputs kept floating point: --no-rescale-outputs)": lambda out: ours(
                    sparse, out, calibration, rescale_outputs=False
                ),
                "nmdeploy INT8 (entropy, no output limit: the earlier default)": lambda out: ours(
                    sparse, out, calibration, method="entropy", output_error_limit=None
                ),
                "nmdeploy INT8 (entropy, no output limit, --no-smooth)": lambda out: ours(
                    sparse, out, calibration, method="entropy", output_error_limit=None, smooth=False
                ),
                "nmdeploy FP8 E4M3 (max)": lambda out: ours(sparse, out, calibration, precision="fp8"),
                "nmdeploy FP8 E4M3 (max, --smooth)": lambda out: ours(
                    sparse, out, calibration, precision="fp8", smooth=True
                ),
                "onnxruntime quantize_static INT8, MatMul only (MinMax, symmetric)": lambda out: onnxruntime_static(
                    sparse, out, feeds, "minmax", ["MatMul"]
                ),
                "onnxruntime quantize_static INT8, MatMul only (MinMax, asymmetric activations: its default)": (
                    lambda out: onnxruntime_static(sparse, out, feeds, "minmax", ["MatMul"], symmetric=False)
                ),
                "onnxruntime quantize_static INT8, MatMul only (Entropy, symmetric)": lambda out: onnxruntime_static(
                    sparse, out, rows_padded(feeds), "entropy", ["MatMul"]
                ),
                "onnxruntime quantize_static INT8, its default op types (MinMax)": lambda out: onnxruntime_static(
                    sparse, out, feeds, "minmax", None
                ),
            }
        )
        modelopt_feeds = rows_padded(feeds)  # one token count: ModelOpt takes one array per input
    else:
        variants.update(
            {
                "nmdeploy INT8 (the default: auto ranges)": lambda out: ours(sparse, out, calibration),
                "nmdeploy INT8 (entropy, no output limit: the earlier default)": lambda out: ours(
                    sparse, out, calibration, method="entropy", output_error_limit=None
                ),
                "nmdeploy FP8 E4M3 (the default: max)": lambda out: ours(sparse, out, calibration, precision="fp8"),
                "onnxruntime quantize_static INT8, Conv/Gemm/MatMul (MinMax, symmetric)": lambda out: (
                    onnxruntime_static(sparse, out, feeds, "minmax", case.op_types)
                ),
            }
        )
        modelopt_feeds = feeds
    if modelopt is None:
        label = "ModelOpt ONNX quantizer INT8"
        variants[label] = unavailable("nvidia-modelopt not installed (or its ONNX extras): see --modelopt-site")
    else:
        label = f"ModelOpt {modelopt} ONNX quantizer INT8 (its defaults, CPU calibration)"
        variants[label] = lambda out: modelopt_int8(modelopt_sites, sparse, out, modelopt_feeds)
    case.variants = variants


class NotRun(Exception):
    """A quantizer that is not installed here: its row says so instead of measuring."""


def unavailable(reason: str) -> Callable[[Path], None]:
    def fail(out: Path) -> None:
        raise NotRun(reason)

    return fail


def short(message: str, limit: int = 120) -> str:
    """One line of at most about ``limit`` characters: the start and the end, where the cause usually is."""
    message = " ".join(message.split())
    if len(message) <= limit:
        return message
    head, tail = message[:40].rsplit(" ", 1)[0], message[-(limit - 45) :].split(" ", 1)[-1]
    return f"{head} ... {tail}"


def measure_case(case: Case, work: Path) -> list[str]:
    rows = []
    blank = " |" * (len(case.measures) + 3)
    for label, make in case.variants.items():
        path = case.sparse if make is None else work / f"{case.title.split()[0]}-variant-{len(rows)}.onnx"
        start = time.perf_counter()
        try:
            if make is not None:
                make(path)
            seconds = time.perf_counter() - start
            figures = case.measure(path)
        except Exception as error:  # an anchor that fails on this model (or writes a model that fails) is a result
            outcome = "not run" if isinstance(error, NotRun) else "failed"
            row = f"| {label} | {outcome}: {short(str(error).replace(str(path), 'its output'))} |{blank}"
            print(row, flush=True)
            rows.append(row)
            continue
        kept, io = pattern_and_io(path) if make is not None else ("-", "-")
        timing = f"{seconds:.1f}" if make is not None else "-"
        shown = " | ".join(
            f"{value:.2f}" if "%" in name else f"{value:.4f}"
            for name, value in zip(case.measures, figures, strict=True)
        )
        row = f"| {label} | {shown} | {timing} | {kept} | {io} |"
        print(row, flush=True)
        rows.append(row)
    header = f"| variant | {' | '.join(case.measures)} | seconds | 2:4 kept | 8-bit in/out |"
    rule = "|---" * (len(case.measures) + 4) + "|"
    return [f"**{case.title}**: {case.note}.", "", header, rule, *rows, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--modelopt-site",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder holding nvidia-modelopt and its ONNX extras (pip install --target); may be repeated",
    )
    args = parser.parse_args()
    models = [name for name in args.models.split(",") if name]
    unknown = [name for name in models if name not in CASES]
    if unknown or not models:
        parser.error(f"unknown models {unknown}; choose from {', '.join(CASES)}")
    modelopt = modelopt_version(args.modelopt_site)
    work = Path(tempfile.mkdtemp(prefix="nmdeploy-quantize-bench-"))
    blocks = []
    for name in models:
        case = CASES[name](work)
        add_variants(case, args.modelopt_site, modelopt)
        blocks.extend(measure_case(case, work))
    section = "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}. Every quantizer calibrates on the 2:4 model's own "
            "calibration data. 2:4 kept: TensorRT-eligible weights still 2:4 behind their DequantizeLinear. 8-bit "
            "in/out: eligible layers whose input and (post-epilogue) output are quantized, TensorRT's condition for "
            "sparse INT8 (and FP8) kernels. FP8 rows are the simulated FP8 graph (Q/DQ pairs in ONNX Runtime). "
            "onnxruntime's default op types quantize Gather, Add, Softmax and the attention MatMuls too; its "
            "MatMul-only Q/DQ also quantizes each MatMul's output, but before its bias Add. ModelOpt: "
            f"{'nvidia-modelopt ' + modelopt if modelopt else 'not installed'}, `calibration_eps=['cpu']`, "
            "`high_precision_dtype='fp32'`, in an interpreter of its own (it patches onnxruntime.quantization), so "
            "its seconds include that interpreter's start and imports. Seconds: the quantizer's own time, on 2 cores "
            "shared with other work.",
            "",
            *blocks,
        ]
    ).rstrip()
    if args.no_write:
        print(section)
    else:
        write_section("quantize", "## Sparse and quantized (`python benchmarks/quantize.py`)", section)


if __name__ == "__main__":
    main()
