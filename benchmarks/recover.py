"""Conversion that keeps the model: recovery (--recover) and the fidelity budget (--min-fidelity), one run.

Every figure is measured on data of another source than the calibration data:

- MiniLM-L6, all 36 encoder Linear weights to 2:4, calibrated on the 171 everyday sentences of
  models/minilm/calibration.txt; evaluated on models/minilm/evaluation.txt (the same kind of text) and on 250
  sentences of technical prose from the docstrings of Python's standard library (a different kind). Mean cosine of
  dense and converted sentence embeddings; seconds are the whole conversion (statistics, fit, recovery, checks).
- Digits CNN: test accuracy, calibrated on 512 training images.
- PP-OCRv4 text detector (a real pretrained Paddle CNN, 41 TensorRT-eligible convolutions; from the
  rapidocr-onnxruntime wheel when installed): calibrated on pages of printed text rendered with Pillow, evaluated
  on pages tiled from scikit-learn's handwritten digit scans; fidelity is the mean cosine of the probability maps
  and the IoU of the text masks (probability > 0.3).

    python benchmarks/recover.py [--no-write] [--skip-minilm] [--skip-digits] [--skip-detector]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from report import machine, write_section

from nmdeploy.calibration.recovery import RecoveryOptions
from nmdeploy.evaluation.budget import convert_within_budget
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.reference import digits, minilm
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

ENCODER = "encoder"
DOC_MODULES = (
    "json", "collections", "itertools", "functools", "pathlib", "argparse", "logging", "email.message",
    "http.client", "unittest", "subprocess", "threading", "socket", "csv", "zipfile", "tarfile", "datetime",
    "decimal", "fractions", "statistics", "random", "heapq", "bisect", "shutil", "tempfile", "textwrap",
    "difflib", "pickle", "sqlite3", "urllib.parse", "xml.etree.ElementTree", "os", "io",
)  # fmt: skip


def docstring_sentences(limit: int = 250) -> list[str]:
    """Sentences of technical prose from the standard library's docstrings: text unlike the calibration set."""
    seen: set[str] = set()
    found = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        members = [v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or inspect.isfunction(v)]
        for item in (module, *members):
            for paragraph in (inspect.getdoc(item) or "").split("\n\n"):
                for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                    plain = 40 <= len(sentence) <= 200 and sentence[0].isupper() and sentence.endswith(".")
                    if plain and ">>>" not in sentence and sentence not in seen:
                        seen.add(sentence)
                        found.append(sentence)
    return found[:limit]


def timed_convert(source: Path, out: Path, *, budget: float | None = None, **options):
    model = OnnxModel.load(source)
    start = time.perf_counter()
    if budget is None:
        report = ConvertPass(**options)(model).report
        result = None
    else:
        result = convert_within_budget(model, min_fidelity=budget, **options)
        model, report = result.model, result.report
    model.save(out)
    return time.perf_counter() - start, report, result


def recover_note(report: list[dict]) -> str:
    row = next((r for r in report if r["step"] == "recover"), None)
    if row is None:
        return ""
    return (
        f"held-out {row['held_out_before']:.4f} -> {row['held_out_after']:.4f} in {row['best_step']}/"
        f"{row['steps_run']} steps ({row['seconds']:.0f} s)"
    )


def minilm_rows(work: Path) -> list[str]:
    model_path = minilm.export_minilm_onnx(work / "minilm.onnx")
    minilm.write_sentence_npz(minilm.sentences("calibration"), work / "calib")
    sets = {
        "same kind": minilm.sentence_feeds(minilm.sentences("evaluation")),
        "other kind": minilm.sentence_feeds(docstring_sentences()),
    }
    dense = {name: minilm.embed_onnx(model_path, feeds) for name, feeds in sets.items()}
    variants = {
        "magnitude": dict(method="magnitude"),
        "sparsegpt sequential (one-shot default)": dict(),
        "sparsegpt sequential + --recover": dict(recover=RecoveryOptions()),
        "... + --recover, outputs only (no block outputs)": dict(recover=RecoveryOptions(blocks=False)),
        "... + --recover, no token augmentation": dict(recover=RecoveryOptions(augment=0.0)),
    }
    rows = []
    for label, options in variants.items():
        out = work / f"minilm-{len(rows)}.onnx"
        seconds, report, budget = timed_convert(model_path, out, calibration=work / "calib", include=ENCODER, **options)
        cosines = {name: minilm.mean_cosine(dense[name], minilm.embed_onnx(out, feeds)) for name, feeds in sets.items()}
        converted = sum(1 for row in report if row["step"] == "convert" and "skipped" not in row)
        note = f"{converted} weights; " + recover_note(report)
        if budget is not None:
            note += f"; budget: held-out {budget.fidelity:.4f}, {len(budget.attempts)} verified sets"
        rows.append(f"| {label} | {cosines['same kind']:.4f} | {cosines['other kind']:.4f} | {seconds:.1f} | {note} |")
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
        with OnnxRuntimeRunner(path) as runner:
            logits = runner.infer(test)[digits.OUTPUT_NAME]
        return float((logits.argmax(axis=1) == splits.test_y.numpy()).mean())

    rows = [f"| dense | {100 * dense_accuracy:.2f} | - | - |"]
    variants = {
        "magnitude": dict(method="magnitude"),
        "magnitude + --recover": dict(method="magnitude", recover=RecoveryOptions()),
        "sparsegpt sequential": dict(),
        "sparsegpt sequential + --recover": dict(recover=RecoveryOptions()),
        "sparsegpt sequential + --recover, outputs only": dict(recover=RecoveryOptions(blocks=False)),
    }
    for label, options in variants.items():
        out = work / f"digits-{len(rows)}.onnx"
        seconds, report, _ = timed_convert(model_path, out, calibration=work / "digits-calib", **options)
        rows.append(f"| {label} | {100 * accuracy(out):.2f} | {seconds:.1f} | {recover_note(report)} |")
        print(rows[-1], flush=True)
    return rows


def detector_path() -> Path | None:
    # Located, not imported: the package's own imports pull in OpenCV, which the model file does not need.
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "models" / "ch_PP-OCRv4_det_infer.onnx"
    return path if path.is_file() else None


def printed_pages(count: int, seed: int, size: int = 160) -> np.ndarray:
    """Pages of printed words (Pillow's built-in font at several sizes), normalised as PP-OCR expects."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    words = " ".join(minilm.sentences("calibration")).split()
    pages = []
    for _ in range(count):
        image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(200, 256, 3)))
        draw = ImageDraw.Draw(image)
        y = int(rng.integers(2, 12))
        while y < size - 16:
            font = ImageFont.load_default(size=int(rng.integers(10, 18)))
            line = " ".join(rng.choice(words, 4))
            draw.text(
                (int(rng.integers(2, 30)), y), line, fill=tuple(int(v) for v in rng.integers(0, 80, 3)), font=font
            )
            y += int(rng.integers(16, 30))
        pages.append(np.asarray(image, dtype=np.float32))
    return _normalise(np.stack(pages))


def handwritten_pages(count: int, seed: int, size: int = 160) -> np.ndarray:
    """Pages tiled from scikit-learn's handwritten digit scans (dark ink on light paper): another source."""
    from sklearn.datasets import load_digits

    images = load_digits().images / 16.0
    rng = np.random.default_rng(seed)
    pages = np.ones((count, size, size), np.float32)
    for page in pages:
        for row in range(4, size - 24, 28):
            for col in range(int(rng.integers(2, 20)), size - 24, 22):
                if rng.random() < 0.8:
                    digit = np.kron(images[rng.integers(len(images))], np.ones((3, 3)))
                    page[row : row + 24, col : col + 24] = 1 - digit
    return _normalise(np.repeat(pages[..., None] * 255, 3, axis=3))


def _normalise(pages: np.ndarray) -> np.ndarray:
    return ((pages / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).astype(np.float32)  # PP-OCR: [-1, 1], NCHW


def mask_iou(reference: dict, candidate: dict, feeds: dict) -> float:
    """IoU of the text masks (probability > 0.3) of the first output."""
    ref, cand = (next(iter(outputs.values())) > 0.3 for outputs in (reference, candidate))
    union = np.logical_or(ref, cand).sum()
    return float(np.logical_and(ref, cand).sum() / union) if union else 1.0


def detector_rows(work: Path) -> list[str]:
    source = detector_path()
    if source is None:
        return ["| PP-OCRv4 detector | - | - | - | rapidocr-onnxruntime not installed |"]
    calibration = work / "det-calib"
    calibration.mkdir()
    pages = printed_pages(48, seed=0)
    for index in range(0, len(pages), 16):
        np.savez(calibration / f"batch-{index:04d}.npz", x=pages[index : index + 16])
    evaluation = handwritten_pages(32, seed=1)
    with OnnxRuntimeRunner(source) as runner:
        dense = [runner.infer({"x": evaluation[i : i + 8]}) for i in range(0, len(evaluation), 8)]

    def evaluate(path: Path) -> tuple[float, float]:
        from nmdeploy.fidelity import fidelity

        with OnnxRuntimeRunner(path) as runner:
            batches = [
                (reference, runner.infer({"x": evaluation[i * 8 : i * 8 + 8]}), {}) for i, reference in enumerate(dense)
            ]
        return fidelity(batches), fidelity(batches, mask_iou)

    rows = []
    variants = {
        "every eligible conv, magnitude": dict(method="magnitude", eligible_only=True),
        "every eligible conv, sparsegpt sequential": dict(eligible_only=True),
        "--min-fidelity 0.95 (cosine)": dict(budget=0.95),
    }
    for label, options in variants.items():
        out = work / f"det-{len(rows)}.onnx"
        seconds, report, budget = timed_convert(source, out, calibration=calibration, **options)
        cosine, iou = evaluate(out)
        if budget is not None:
            share = budget.converted_parameters / budget.eligible_parameters
            note = (
                f"{sum(r.converted for r in budget.layers)} convs, {share:.0%} of the eligible parameters; "
                f"held-out (printed) cosine {budget.fidelity:.4f}; {len(budget.attempts)} verified sets"
            )
        else:
            note = f"{sum(1 for r in report if r['step'] == 'convert' and 'skipped' not in r)} convs"
        rows.append(f"| {label} | {cosine:.4f} | {iou:.3f} | {seconds:.1f} | {note} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--skip-digits", action="store_true")
    parser.add_argument("--skip-detector", action="store_true")
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-recover-") as folder:
        work = Path(folder)
        digit_rows = [] if args.skip_digits else digits_rows(work)
        detector_table = [] if args.skip_detector else detector_rows(work)
        minilm_table = [] if args.skip_minilm else minilm_rows(work)
    section = "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}; load at the start: `{load}`.",
            "",
            "MiniLM-L6, all 36 encoder Linear weights to 2:4, calibrated on the 171 sentences of "
            "models/minilm/calibration.txt (recovery trains on 4/5 of them and stops early on the rest). Mean "
            "embedding cosine against the dense model on models/minilm/evaluation.txt (same kind of text) and on "
            "250 sentences of the standard library's docstrings (another kind). Seconds: the whole conversion.",
            "",
            "| variant | cosine, same kind | cosine, other kind | seconds | notes |",
            "|---|---:|---:|---:|---|",
            *minilm_table,
            "",
            "Digits CNN (450 test images), calibrated on 512 training images:",
            "",
            "| variant | test accuracy % | seconds | notes |",
            "|---|---:|---:|---|",
            *digit_rows,
            "",
            "PP-OCRv4 text detector (pretrained, 41 TensorRT-eligible convolutions, 1.1 M eligible parameters), "
            "calibrated on 48 pages of printed text, evaluated on 32 pages of handwritten digit scans. Recovery "
            "is not offered: the interpreter lacks HardSigmoid, Resize and ConvTranspose, and --recover says so.",
            "",
            "| variant | map cosine | mask IoU | seconds | notes |",
            "|---|---:|---:|---:|---|",
            *detector_table,
        ]
    )
    print(section)
    if not args.no_write:
        write_section("recover", "## Recovery and the fidelity budget (`python benchmarks/recover.py`)", section)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    main()
