"""The pretrained PP-OCRv6 small text detector: its ONNX file, calibration and evaluation images, and mask IoU.

A real convolutional network (2.45 M parameters, 83 convolutions of which 61 weights are TensorRT-eligible for 2:4)
exported from PaddlePaddle by the RapidOCR project and shipped inside the ``rapidocr`` wheel (Apache-2.0), used as
is: no export step. ``python -m nmdeploy.reference.ppocr`` takes it out of that wheel once, checked against pinned
hashes, without installing rapidocr. Input ``x``: float32 ``[batch, 3, H, W]`` in BGR order, each channel
``(pixel / 255 - 0.5) / 0.5``, H and W multiples of 32; output ``fetch_name_0``: ``[batch, 1, H, W]``, the
probability that each pixel is text. RapidOCR thresholds it at 0.3 to draw boxes, and the task measure here is the
intersection over union of those text masks, converted model against dense.

The two image sets come from different sources, and both are made at run time from what packages ship:

- calibration: crops of the two photographs scikit-learn ships (``load_sample_images``) and pages of scikit-learn's
  handwritten digits laid out in lines, dark ink on light paper;
- evaluation: printed words from ``models/minilm/evaluation.txt`` rendered with Pillow's bundled font at several
  sizes and colours on paper-like, gradient and dark backgrounds (fixed seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.imports import require
from nmdeploy.reference import batch_file_name, ppocr, write_npz

INPUT_NAME = "x"
OUTPUT_NAME = "fetch_name_0"
MODEL_FILE = ppocr.DETECTOR
TEXT_THRESHOLD = 0.3
IMAGE_SIZE = 256
_INSTALL = "pip install 'nmdeploy[models]'"


def model_path() -> Path:
    """The detector's ONNX file, as ``python -m nmdeploy.reference.ppocr`` prepared it."""
    return ppocr.model_file(MODEL_FILE)


def preprocess(images: np.ndarray) -> np.ndarray:
    """RGB uint8 ``[B, H, W, 3]`` -> the detector's input: BGR, scaled to [-1, 1], float32 ``[B, 3, H, W]``."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise InputError(f"images must be uint8 [B, H, W, 3], got {images.dtype} {list(images.shape)}")
    if images.shape[1] % 32 or images.shape[2] % 32:
        raise InputError(f"image height and width must be multiples of 32, got {images.shape[1]}x{images.shape[2]}")
    bgr = images[..., ::-1].astype(np.float32)
    return np.ascontiguousarray(((bgr / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2))


def _crop(image: np.ndarray, top: int, left: int, size: int) -> np.ndarray:
    return image[top : top + size, left : left + size]


def _digit_page(rng: np.random.Generator, digits: np.ndarray, size: int) -> np.ndarray:
    """Handwritten digits (8x8, values 0..16) scaled up and set in lines of 'words' on light paper."""
    page = np.full((size, size), 235.0) + rng.normal(0, 4, (size, size))
    y = int(rng.integers(4, 20))
    while True:
        scale = int(rng.integers(2, 5))
        glyph = 8 * scale
        if y + glyph > size - 4:
            break
        x = int(rng.integers(4, 40))
        while x + glyph <= size - 4:
            for _ in range(int(rng.integers(2, 7))):
                if x + glyph > size - 4:
                    break
                ink = np.kron(digits[int(rng.integers(len(digits)))], np.ones((scale, scale))) / 16.0
                page[y : y + glyph, x : x + glyph] -= ink * rng.uniform(150, 220)
                x += glyph
            x += int(rng.integers(glyph // 2, 2 * glyph))
        y += glyph + int(rng.integers(glyph // 3, 2 * glyph))
    grey = np.clip(page, 0, 255).astype(np.uint8)
    return np.repeat(grey[:, :, None], 3, axis=2)


def calibration_images(count: int = 16, size: int = IMAGE_SIZE, seed: int = 0) -> np.ndarray:
    """RGB uint8 ``[count, size, size, 3]``: photo crops and handwritten-digit pages, alternately."""
    if count < 1 or size < 32 or size % 32:
        raise InputError(f"count must be >= 1 and size a multiple of 32 (>= 32), got count={count}, size={size}")
    require("sklearn", purpose="the calibration images", package="scikit-learn", install=_INSTALL)
    from sklearn.datasets import load_digits, load_sample_images

    rng = np.random.default_rng(seed)
    photos = load_sample_images().images
    digits = load_digits().images
    images = []
    for index in range(count):
        if index % 2 == 0:
            photo = photos[(index // 2) % len(photos)]
            side = min(photo.shape[:2])
            crop = min(side, int(rng.integers(size, 2 * size)))
            top = int(rng.integers(0, photo.shape[0] - crop + 1))
            left = int(rng.integers(0, photo.shape[1] - crop + 1))
            images.append(_resize(_crop(photo, top, left, crop), size))
        else:
            images.append(_digit_page(rng, digits, size))
    return np.stack(images)


def _resize(image: np.ndarray, size: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.BILINEAR))


def evaluation_images(count: int = 16, size: int = IMAGE_SIZE, seed: int = 1) -> np.ndarray:
    """RGB uint8 ``[count, size, size, 3]``: rendered lines of printed English words on varied backgrounds."""
    if count < 1 or size < 32 or size % 32:
        raise InputError(f"count must be >= 1 and size a multiple of 32 (>= 32), got count={count}, size={size}")
    require("PIL", purpose="the evaluation images", package="Pillow", install=_INSTALL)
    from PIL import Image, ImageDraw, ImageFont

    from nmdeploy.reference import minilm

    words = " ".join(minilm.sentences("evaluation")).split()
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    images = []
    for index in range(count):
        style = index % 3
        if style == 0:  # paper: light, slightly noisy
            background = rng.uniform(200, 250) + rng.normal(0, 6, (size, size))
        elif style == 1:  # a light gradient across the image
            background = rng.uniform(150, 210) + rng.uniform(20, 45) * (xx * rng.uniform(-1, 1) + yy)
        else:  # dark background, light text
            background = rng.uniform(20, 70) + rng.normal(0, 6, (size, size))
        tint = rng.uniform(0.85, 1.0, 3)
        canvas = Image.fromarray(np.clip(background[:, :, None] * tint, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(canvas)
        y = int(rng.integers(4, 24))
        while y < size - 16:
            font_size = int(rng.integers(12, 34))
            font = ImageFont.load_default(size=font_size)
            start = int(rng.integers(len(words) - 8))
            line = " ".join(words[start : start + int(rng.integers(2, 7))])
            ink = rng.uniform(0, 70, 3) if style != 2 else rng.uniform(190, 255, 3)
            draw.text((int(rng.integers(2, size // 3)), y), line, font=font, fill=tuple(int(c) for c in ink))
            y += font_size + int(rng.integers(font_size // 2, 2 * font_size))
        images.append(np.asarray(canvas))
    return np.stack(images)


def image_feeds(images: np.ndarray, batch: int = 8) -> list[dict[str, np.ndarray]]:
    """The detector's input in batches of ``batch``: [{"x": float32 [b, 3, H, W]}, ...]."""
    if batch < 1:
        raise InputError(f"batch must be at least 1, got {batch}")
    inputs = preprocess(images)
    return [{INPUT_NAME: inputs[start : start + batch]} for start in range(0, len(inputs), batch)]


def write_image_npz(images: np.ndarray, path_or_folder: str | Path, batch: int = 8) -> list[Path]:
    """Write the preprocessed images as .npz, the format of ``--calib``/``--data``: one file if the path ends in
    ``.npz``, else one file per ``batch`` images in that folder."""
    destination = Path(path_or_folder)
    if destination.suffix == ".npz":
        return [write_npz({INPUT_NAME: preprocess(images)}, destination)]
    return [
        write_npz(feed, destination / batch_file_name(index)) for index, feed in enumerate(image_feeds(images, batch))
    ]


def detect_onnx(path: str | Path, feeds: Sequence[dict[str, np.ndarray]]) -> np.ndarray:
    """Text probability maps ``[N, 1, H, W]`` of every batch, from the model at ``path`` in ONNX Runtime on CPU."""
    from nmdeploy.runtimes.backends import run_batches

    return run_batches(path, feeds, OUTPUT_NAME)


def mask_iou(reference: np.ndarray, candidate: np.ndarray, threshold: float = TEXT_THRESHOLD) -> float:
    """Intersection over union of the text masks (probability > ``threshold``) over all pixels of all images.

    1.0 when both masks are empty (nothing to disagree on).
    """
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.shape != candidate.shape:
        raise InputError(f"probability maps differ in shape: {list(reference.shape)} vs {list(candidate.shape)}")
    dense, converted = reference > threshold, candidate > threshold
    union = int(np.logical_or(dense, converted).sum())
    return 1.0 if union == 0 else int(np.logical_and(dense, converted).sum()) / union
