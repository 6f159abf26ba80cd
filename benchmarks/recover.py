"""Conversion that keeps the model: recovery (--recover) and the fidelity budget (--min-fidelity), one run.

Every figure is measured on data of another source than the calibration data:

- MiniLM-L6, all 36 encoder Linear weights to 2:4, calibrated on the 171 everyday sentences of
  models/minilm/calibration.txt; evaluated on models/minilm/evaluation.txt (the same kind of text), on 250
  sentences of technical prose from the docstrings of Python's standard library (a different kind) and on the
  sentences of scikit-learn's data set descriptions (a third kind). Mean cosine of dense and converted sentence
  embeddings; seconds are the whole conversion (statistics, fit, recovery, checks). Recovery once more in float32
  beside the default (bfloat16 where the CPU has it): the same steps, side by side.
- Digits CNN: test accuracy, calibrated on 512 training images.
- PP-OCRv6 small text detector and the PaddleOCR text-line orientation classifier (real pretrained Paddle CNNs from
  the rapidocr wheel, nmdeploy.reference.textdet / textcls): calibrated on two sources, crops of scikit-learn's two
  sample photographs and pages of its handwritten digit scans; evaluated on a third, printed English words rendered
  with Pillow's bundled font. The budget's held-out split comes from the calibration sources only. Detector:
  mean cosine of the probability maps and IoU of the text masks (> 0.3); classifier: top-1 agreement with the dense
  model (the budget's metric) and accuracy against the orientation labels.

    python benchmarks/recover.py [--no-write] [--only minilm digits detector classifier] [--steps N]

Without --only every table runs and the whole section is rewritten; with it, only the named tables are measured
and printed (BENCHMARKS.md is written only when all four ran).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from digits_bench import digits_bench
from report import machine, write_section

from nmdeploy.conversion.budget import BudgetReport
from nmdeploy.conversion.controller import Conversion
from nmdeploy.conversion.recovery import DEFAULT_STEPS, RecoveryOptions
from nmdeploy.errors import InputError
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks import Pattern
from nmdeploy.reference import minilm, textcls, textdet
from nmdeploy.rows import ReportRow

TABLES = ("minilm", "digits", "detector", "classifier")
ENCODER = "encoder"
CNN_STEPS = 150
DETECTOR_SIZE = 160  # pixels; a multiple of 32, small enough for recovery's backward passes on two cores
DETECTOR_CALIBRATION, DETECTOR_EVALUATION = 48, 32  # images
CLASSIFIER_CALIBRATION, CLASSIFIER_EVALUATION = 128, 256  # text lines
DOC_MODULES = (
    "json", "collections", "itertools", "functools", "pathlib", "argparse", "logging", "email.message",
    "http.client", "unittest", "subprocess", "threading", "socket", "csv", "zipfile", "tarfile", "datetime",
    "decimal", "fractions", "statistics", "random", "heapq", "bisect", "shutil", "tempfile", "textwrap",
    "difflib", "pickle", "sqlite3", "urllib.parse", "xml.etree.ElementTree", "os", "io",
)  # fmt: skip


def plain_sentences(paragraphs, limit: int, banned: str) -> list[str]:
    """The distinct sentences of ``paragraphs`` that read as prose (40-200 characters, capitalised, ending in a full
    stop, without ``banned``), in order, at most ``limit``."""
    found: dict[str, None] = {}  # insertion-ordered
    for paragraph in paragraphs:
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
            plain = 40 <= len(sentence) <= 200 and sentence[0].isupper() and sentence.endswith(".")
            if plain and banned not in sentence:
                found[sentence] = None
                if len(found) == limit:
                    return list(found)
    return list(found)


def docstring_sentences(limit: int = 250) -> list[str]:
    """Sentences of technical prose from the standard library's docstrings: text unlike the calibration set."""

    def paragraphs():
        for name in DOC_MODULES:
            module = importlib.import_module(name)
            members = [v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or inspect.isfunction(v)]
            for item in (module, *members):
                yield from (inspect.getdoc(item) or "").split("\n\n")

    return plain_sentences(paragraphs(), limit, banned=">>>")


def dataset_description_sentences(limit: int = 200) -> list[str]:
    """Sentences of scikit-learn's data set descriptions (a third kind of text: academic prose about data)."""
    import sklearn

    def paragraphs():
        for path in sorted((Path(sklearn.__file__).parent / "datasets" / "descr").glob("*.rst")):
            for paragraph in path.read_text(encoding="utf-8").split("\n\n"):
                if not paragraph.strip().startswith((":", "..", "=", "-", "*", "|")):  # fields, directives, tables
                    yield paragraph

    return plain_sentences(paragraphs(), limit, banned="::")


def timed_convert(source: Path, out: Path, *, budget: float | None = None, **options):
    """Convert ``source`` into ``out`` (within a fidelity budget when ``budget`` is given): seconds, rows, result."""
    model = OnnxModel.load(source)
    start = time.perf_counter()
    rows = Conversion(min_fidelity=budget, **options)(model).report
    result = next((row for row in rows if isinstance(row, BudgetReport)), None)
    report = [row for row in rows if not isinstance(row, BudgetReport)]
    model.save(out)
    return time.perf_counter() - start, report, result


def converted_weights(report: list[ReportRow]) -> list[str]:
    return [row.weight for row in report if row.step == "convert" and not row.skipped]


def recover_note(report: list[ReportRow]) -> str:
    row = next((r for r in report if r.step == "recover"), None)
    if row is None:
        return ""
    return (
        f"held-out {row.held_out_before:.4f} -> {row.held_out_after:.4f} in {row.best_step}/"
        f"{row.steps_run} steps ({row.seconds:.0f} s, {row.precision})"
    )


def eligible_parameters(path: Path) -> dict[str, int]:
    """Parameters of every weight TensorRT could run 2:4, by weight name."""
    return {
        weight.name: int(np.prod(weight.shape))
        for weight in find_prunable_weights(OnnxModel.load(path).proto).weights
        if tensorrt_verdict(weight, Pattern(2, 4)).eligible
    }


def conversion_note(report: list[ReportRow], budget: BudgetReport | None, eligible: dict[str, int], unit: str) -> str:
    """How much was converted (share of the TensorRT-eligible parameters), and the budget's and recovery's figures."""
    names = converted_weights(report)
    share = sum(eligible.get(name, 0) for name in names) / sum(eligible.values())
    note = f"{len(names)} {unit}, {share:.0%} of the eligible parameters"
    if budget is not None:
        note += (
            f"; held-out (calibration sources) {budget.metric} {budget.fidelity:.4f}, "
            f"{len(budget.attempts)} verified sets"
        )
    recovered = recover_note(report)
    return note + (f"; {recovered}" if recovered else "")


def minilm_rows(work: Path, steps: int) -> list[str]:
    model_path = minilm.export_minilm_onnx(work / "minilm.onnx")
    minilm.write_sentence_npz(minilm.sentences("calibration"), work / "calib")
    sets = {
        "same kind": minilm.sentence_feeds(minilm.sentences("evaluation")),
        "other kind": minilm.sentence_feeds(docstring_sentences()),
        "third kind": minilm.sentence_feeds(dataset_description_sentences()),
    }
    dense = {name: minilm.embed_onnx(model_path, feeds) for name, feeds in sets.items()}
    longer = round(steps * 1.4)
    variants = {
        "magnitude": dict(method="magnitude"),
        "sparsegpt sequential (one-shot default)": dict(),
        "sparsegpt sequential + --recover": dict(recover=RecoveryOptions(steps=steps)),
        "sparsegpt sequential + --recover --recover-precision float32": dict(
            recover=RecoveryOptions(steps=steps, precision="float32")
        ),
        f"sparsegpt sequential + --recover {longer}": dict(recover=RecoveryOptions(steps=longer)),
    }
    rows = []
    for label, options in variants.items():
        out = work / f"minilm-{len(rows)}.onnx"
        seconds, report, _ = timed_convert(model_path, out, calibration=work / "calib", include=ENCODER, **options)
        cosines = {name: minilm.mean_cosine(dense[name], minilm.embed_onnx(out, feeds)) for name, feeds in sets.items()}
        note = "; ".join(filter(None, [f"{len(converted_weights(report))} weights", recover_note(report)]))
        cells = " | ".join(f"{cosines[name]:.4f}" for name in sets)
        rows.append(f"| {label} | {cells} | {seconds:.1f} | {note} |")
        print(rows[-1], flush=True)
    return rows


def digits_rows(work: Path, steps: int) -> list[str]:
    bench = digits_bench(work)
    rows = [f"| dense (the same seeded training) | {100 * bench.dense_accuracy:.2f} | - | - |"]
    variants = {
        "magnitude": dict(method="magnitude"),
        "magnitude + --recover": dict(method="magnitude", recover=RecoveryOptions(steps=steps)),
        "sparsegpt sequential": dict(),
        "sparsegpt sequential + --recover": dict(recover=RecoveryOptions(steps=steps)),
    }
    for label, options in variants.items():
        out = work / f"digits-{len(rows)}.onnx"
        seconds, report, _ = timed_convert(bench.model, out, calibration=bench.calibration, **options)
        rows.append(f"| {label} | {100 * bench.accuracy(out):.2f} | {seconds:.1f} | {recover_note(report)} |")
        print(rows[-1], flush=True)
    return rows


def cnn_variants(steps: int, metric: str) -> dict[str, dict]:
    """Whole-model conversion with and without recovery beside the fidelity budget with and without it.

    Recovery stops early on held-out cosine, a finer signal than top-1 on a few dozen held-out rows.
    """
    recover = RecoveryOptions(steps=steps)
    return {
        "every eligible conv, magnitude": dict(method="magnitude", eligible_only=True),
        "every eligible conv, sparsegpt sequential": dict(eligible_only=True),
        "every eligible conv, sparsegpt sequential + --recover": dict(eligible_only=True, recover=recover),
        f"--min-fidelity 0.95 ({metric})": dict(budget=0.95, metric=metric),
        f"--min-fidelity 0.95 ({metric}) + --recover": dict(budget=0.95, metric=metric, recover=recover),
    }


def cnn_rows(source: Path, calibration: Path, work: Path, steps: int, metric: str, measure) -> list[str]:
    """One row per CNN variant: ``measure(path)`` gives the quality cells of the converted model at ``path``."""
    eligible = eligible_parameters(source)
    rows = []
    for label, options in cnn_variants(steps, metric).items():
        out = work / f"{calibration.name}-{len(rows)}.onnx"
        try:
            seconds, report, budget = timed_convert(source, out, calibration=calibration, **options)
        except InputError as error:  # the budget refuses a model with nothing worth converting
            rows.append(f"| {label} | - | - | - | refused: {error} |")
        else:
            note = conversion_note(report, budget, eligible, "convs")
            rows.append(f"| {label} | {measure(out)} | {seconds:.1f} | {note} |")
        print(rows[-1], flush=True)
    return rows


def detector_rows(work: Path, steps: int) -> list[str]:
    source = textdet.model_path()
    calibration = work / "det-calib"
    images = textdet.calibration_images(DETECTOR_CALIBRATION, size=DETECTOR_SIZE)
    textdet.write_image_npz(images, calibration, batch=16)
    evaluation = textdet.image_feeds(textdet.evaluation_images(DETECTOR_EVALUATION, size=DETECTOR_SIZE))
    dense = textdet.detect_onnx(source, evaluation)

    def measure(path: Path) -> str:
        maps = textdet.detect_onnx(path, evaluation)
        cosine = minilm.mean_cosine(dense.reshape(len(dense), -1), maps.reshape(len(maps), -1))
        return f"{cosine:.4f} | {textdet.mask_iou(dense, maps):.3f}"

    return cnn_rows(source, calibration, work, steps, "cosine", measure)


def classifier_rows(work: Path, steps: int) -> list[str]:
    source = textcls.model_path()
    calibration = work / "cls-calib"
    textcls.write_line_npz(textcls.calibration_lines(CLASSIFIER_CALIBRATION)[0], calibration)
    lines, labels = textcls.evaluation_lines(CLASSIFIER_EVALUATION)
    evaluation = textcls.line_feeds(lines)
    dense = textcls.classify_onnx(source, evaluation)

    def measure(path: Path) -> str:
        scores = textcls.classify_onnx(path, evaluation)
        return f"{textcls.top1_agreement(dense, scores):.3f} | {100 * textcls.accuracy(scores, labels):.1f}"

    dense_row = f"| dense | 1.000 | {100 * textcls.accuracy(dense, labels):.1f} | - | - |"
    return [dense_row, *cnn_rows(source, calibration, work, steps, "top1", measure)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--only", nargs="+", choices=TABLES, default=TABLES, help="measure these tables only")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="recovery steps (--recover STEPS)")
    parser.add_argument(
        "--cnn-steps",
        type=int,
        default=CNN_STEPS,
        help="recovery steps for the Paddle CNNs (a step on a batch of detector images costs about a second here)",
    )
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    builders = {"minilm": minilm_rows, "digits": digits_rows, "detector": detector_rows, "classifier": classifier_rows}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-recover-") as folder:
        steps = {"detector": args.cnn_steps, "classifier": args.cnn_steps}
        tables = {
            name: builders[name](Path(folder), steps.get(name, args.steps)) for name in TABLES if name in args.only
        }
    minutes = (time.perf_counter() - start) / 60
    detector_eligible = eligible_parameters(textdet.model_path()) if "detector" in tables else {}
    classifier_eligible = eligible_parameters(textcls.model_path()) if "classifier" in tables else {}
    parts = [
        f"Measured {datetime.date.today()} on {machine()}; load at the start: `{load}`; {minutes:.0f} minutes in "
        f"all. Recovery: {args.steps} steps at most ({args.cnn_steps} on the Paddle CNNs) unless a row says otherwise.",
    ]
    if "minilm" in tables:
        parts += [
            "MiniLM-L6, all 36 encoder Linear weights to 2:4, calibrated on the 171 sentences of "
            "models/minilm/calibration.txt (recovery trains on 4/5 of them and stops early on the rest). Mean "
            "embedding cosine against the dense model on models/minilm/evaluation.txt (same kind of text), on "
            "250 sentences of the standard library's docstrings (another kind) and on the sentences of "
            "scikit-learn's data set descriptions (a third kind). Seconds: the whole conversion.",
            "| variant | cosine, same kind | cosine, other kind | cosine, third kind | seconds | notes |",
            "|---|---:|---:|---:|---:|---|",
            *tables["minilm"],
        ]
    if "digits" in tables:
        parts += [
            "Digits CNN (450 test images), calibrated on 512 training images:",
            "| variant | test accuracy % | seconds | notes |",
            "|---|---:|---:|---|",
            *tables["digits"],
        ]
    if "detector" in tables:
        parts += [
            f"PP-OCRv6 small text detector (pretrained; {len(detector_eligible)} TensorRT-eligible convolutions, "
            f"{sum(detector_eligible.values()) / 1e6:.2f} M eligible parameters). Calibrated on "
            f"{DETECTOR_CALIBRATION} images of {DETECTOR_SIZE}x{DETECTOR_SIZE} from two sources (photo crops and "
            f"handwritten-digit pages, alternately); evaluated on {DETECTOR_EVALUATION} images of a third (printed "
            "words rendered with Pillow). Map cosine and mask IoU on the evaluation images against the dense model.",
            "| variant | map cosine | mask IoU | seconds | notes |",
            "|---|---:|---:|---:|---|",
            *tables["detector"],
        ]
    if "classifier" in tables:
        parts += [
            f"PaddleOCR text-line orientation classifier (pretrained; weights in Constant nodes; "
            f"{len(classifier_eligible)} TensorRT-eligible convolutions, {sum(classifier_eligible.values()):,} "
            f"eligible parameters). Calibrated on {CLASSIFIER_CALIBRATION} line strips of the same two sources, half "
            f"turned upside down; evaluated on {CLASSIFIER_EVALUATION} lines of rendered printed words (a third "
            "source). Top-1 agreement with the dense model and accuracy against the orientation labels.",
            "| variant | top-1 agreement | accuracy % | seconds | notes |",
            "|---|---:|---:|---:|---|",
            *tables["classifier"],
        ]
    # Paragraphs are separated by a blank line; the rows of a table follow each other.
    section = "\n".join(
        part if not i or (part.startswith("|") and parts[i - 1].startswith("|")) else f"\n{part}"
        for i, part in enumerate(parts)
    )
    print(section)
    if not args.no_write and set(tables) == set(TABLES):
        write_section("recover", "## Recovery and the fidelity budget (`python benchmarks/recover.py`)", section)
    elif not args.no_write:
        print("(a subset of the tables: BENCHMARKS.md left as it is)")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    main()
