"""The pretrained PaddleOCR text-line orientation classifier: its ONNX file, labelled line images, and top-1.

A real MobileNetV3-style CNN classifier (0.1 M parameters; 43 convolution weights, 35 of them TensorRT-eligible;
its weights are stored in Constant nodes, not initializers) shipped inside the ``rapidocr`` wheel (Apache-2.0) and
taken out of it by ``python -m nmdeploy.reference.ppocr``.
It tells whether a cropped text line is upright (class 0) or upside down (class 1, rotated by 180 degrees). Input
``x``: float32 ``[batch, 3, 48, 192]``, BGR, ``(pixel / 255 - 0.5) / 0.5``, the line scaled to height 48 and padded
with zeros on the right; output: ``[batch, 2]`` class probabilities.

Line images carry labels (half of each set is turned upside down), so both top-1 agreement with the dense model and
accuracy can be measured. As for the detector, the sets come from different sources: calibration lines are
handwritten scikit-learn digits and strips of scikit-learn's sample photographs; evaluation lines are printed words
of ``models/minilm/evaluation.txt`` rendered with Pillow's bundled font.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.reference import batch_file_name, ppocr, textdet, write_npz

INPUT_NAME = "x"
MODEL_FILE = ppocr.CLASSIFIER
LINE_SHAPE = (48, 192)


def model_path() -> Path:
    """The classifier's ONNX file, as ``python -m nmdeploy.reference.ppocr`` prepared it."""
    return ppocr.model_file(MODEL_FILE)


def preprocess(lines: Sequence[np.ndarray]) -> np.ndarray:
    """RGB uint8 line images ``[h, w, 3]`` of any size -> float32 ``[N, 3, 48, 192]`` as RapidOCR prepares them."""
    from PIL import Image

    height, width = LINE_SHAPE
    batch = np.zeros((len(lines), 3, height, width), dtype=np.float32)
    for index, line in enumerate(lines):
        line = np.asarray(line)
        if line.ndim != 3 or line.shape[2] != 3 or line.dtype != np.uint8 or min(line.shape[:2]) < 1:
            raise InputError(f"line {index} must be uint8 [h, w, 3], got {line.dtype} {list(line.shape)}")
        scaled = min(width, int(np.ceil(height * line.shape[1] / line.shape[0])))
        resized = np.asarray(Image.fromarray(line).resize((scaled, height), Image.Resampling.BILINEAR))
        batch[index, :, :, :scaled] = (resized[..., ::-1].astype(np.float32).transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return batch


def _upside_down(lines: list[np.ndarray], rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    labels = np.zeros(len(lines), dtype=np.int64)
    labels[rng.permutation(len(lines))[: len(lines) // 2]] = 1
    turned = [line[::-1, ::-1].copy() if flip else line for line, flip in zip(lines, labels, strict=True)]
    return turned, labels


def calibration_lines(count: int = 64, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """``count`` line images and their labels (1 = upside down): strips of digit pages and of photographs."""
    if count < 2:
        raise InputError(f"count must be at least 2, got {count}")
    rng = np.random.default_rng(seed)
    pages = textdet.calibration_images(count=max(2, count // 4), seed=seed)
    lines = []
    for index in range(count):
        page = pages[index % len(pages)]
        height = int(rng.integers(24, 64))
        top = int(rng.integers(0, page.shape[0] - height))
        left = int(rng.integers(0, page.shape[1] // 4))
        lines.append(page[top : top + height, left : left + int(rng.integers(3, 8)) * height])
    return _upside_down(lines, rng)


def evaluation_lines(count: int = 128, seed: int = 1) -> tuple[list[np.ndarray], np.ndarray]:
    """``count`` rendered lines of printed English words and their labels (1 = upside down)."""
    if count < 2:
        raise InputError(f"count must be at least 2, got {count}")
    from PIL import Image, ImageDraw, ImageFont

    from nmdeploy.reference import minilm

    words = " ".join(minilm.sentences("evaluation")).split()
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(count):
        font = ImageFont.load_default(size=int(rng.integers(16, 40)))
        start = int(rng.integers(len(words) - 8))
        text = " ".join(words[start : start + int(rng.integers(2, 6))])
        left, top, right, bottom = font.getbbox(text)
        margin = int(rng.integers(2, 8))
        dark = rng.random() < 0.25
        paper = rng.uniform(20, 70, 3) if dark else rng.uniform(190, 250, 3)
        ink = rng.uniform(190, 255, 3) if dark else rng.uniform(0, 80, 3)
        canvas = Image.new("RGB", (right - left + 2 * margin, bottom - top + 2 * margin), tuple(int(c) for c in paper))
        ImageDraw.Draw(canvas).text((margin - left, margin - top), text, font=font, fill=tuple(int(c) for c in ink))
        noisy = np.asarray(canvas).astype(np.float32) + rng.normal(0, 4, (canvas.height, canvas.width, 1))
        lines.append(np.clip(noisy, 0, 255).astype(np.uint8))
    return _upside_down(lines, rng)


def line_feeds(lines: Sequence[np.ndarray], batch: int = 32) -> list[dict[str, np.ndarray]]:
    """The classifier's input in batches of ``batch``: [{"x": float32 [b, 3, 48, 192]}, ...]."""
    if batch < 1:
        raise InputError(f"batch must be at least 1, got {batch}")
    inputs = preprocess(lines)
    return [{INPUT_NAME: inputs[start : start + batch]} for start in range(0, len(inputs), batch)]


def write_line_npz(lines: Sequence[np.ndarray], folder: str | Path, batch: int = 32) -> list[Path]:
    """Write the preprocessed lines into ``folder``, one .npz per ``batch`` (the format of ``--calib``/``--data``)."""
    return [write_npz(feed, Path(folder) / batch_file_name(i)) for i, feed in enumerate(line_feeds(lines, batch))]


def classify_onnx(path: str | Path, feeds: Sequence[dict[str, np.ndarray]]) -> np.ndarray:
    """Class probabilities ``[N, 2]`` of every batch, from the model at ``path`` in ONNX Runtime on CPU."""
    from nmdeploy.runtimes.backends import run_batches

    return run_batches(path, feeds)


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The fraction of lines on which both models choose the same class."""
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.shape != candidate.shape or reference.ndim != 2:
        raise InputError(f"class scores differ in shape: {list(reference.shape)} vs {list(candidate.shape)}")
    return float((reference.argmax(axis=1) == candidate.argmax(axis=1)).mean())


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of lines whose orientation the model gets right."""
    return float((np.asarray(scores).argmax(axis=1) == np.asarray(labels)).mean())
