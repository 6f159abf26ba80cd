"""Magnitude pruning against calibrated conversion on a real CRNN text reader (a bidirectional LSTM, CTC output).

    python benchmarks/recurrent.py MODEL.onnx

MODEL is ddddocr's common.onnx (pip download --no-deps ddddocr; the wheel holds it): input [1, 1, 64, width],
output [steps, 1, classes] with class 0 the CTC blank. Captcha-like images are drawn with Pillow's default font
(5 characters, grey levels and noise drawn from a seeded generator): 24 to calibrate, 16 others to judge. For every
layer and for the LSTM alone, ``prune`` (magnitude) and ``convert`` (calibrated on the 24): how often the greedy
CTC decoding of each judged image stays the same as the dense model's, the per-step argmax agreement, and the
relative error of the logits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime
from PIL import Image, ImageDraw, ImageFont

from nmdeploy.cli import main as nmdeploy

CHARACTERS = list("abcdefghjkmnpqrstuvwxyz23456789")


def images(rng: np.random.Generator, count: int, width: int = 160) -> list[np.ndarray]:
    font = ImageFont.load_default(size=36)
    drawn = []
    for _ in range(count):
        image = Image.new("L", (width, 64), color=int(rng.integers(200, 256)))
        text = "".join(rng.choice(CHARACTERS, 5))
        position = (int(rng.integers(2, 30)), int(rng.integers(0, 14)))
        ImageDraw.Draw(image).text(position, text, fill=int(rng.integers(0, 80)), font=font)
        pixels = np.asarray(image, np.float32)[None, None] / 255.0
        drawn.append(pixels + rng.normal(0, 0.05, pixels.shape).astype(np.float32))
    return drawn


def decode(logits: np.ndarray) -> tuple[int, ...]:
    """Greedy CTC: the argmax per step, repeats merged, blanks (class 0) dropped."""
    best = logits.reshape(logits.shape[0], -1).argmax(-1)
    return tuple(int(c) for k, c in enumerate(best) if c != 0 and (k == 0 or c != best[k - 1]))


def outputs(path: Path, judged: list[np.ndarray]) -> list[np.ndarray]:
    onnxruntime.set_default_logger_severity(3)  # the model declares its output [1, steps]; it is [steps, 1, classes]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [session.run(None, {session.get_inputs()[0].name: x})[0] for x in judged]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    calibration, judged = images(rng, 24), images(rng, 16)
    dense = outputs(args.model, judged)
    print("| layers | method | decoded strings kept | per-step argmax agreement | relative error | seconds |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "calib").mkdir()
        for k, x in enumerate(calibration):
            np.savez(folder / "calib" / f"{k:03d}.npz", input1=x)
        for selection, include in (("all", []), ("LSTM only", ["--include", "LSTM"])):
            for verb, extra in (("prune", []), ("convert", ["--calib", str(folder / "calib")])):
                out = folder / f"{verb}-{len(include)}.onnx"
                start = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    code = nmdeploy([verb, str(args.model), "-o", str(out), *extra, *include])
                seconds = time.perf_counter() - start
                if code != 0:
                    raise SystemExit(f"{verb} exited {code}")
                candidate = outputs(out, judged)
                kept = np.mean([decode(a) == decode(b) for a, b in zip(dense, candidate, strict=True)])
                steps = np.mean([(a.argmax(-1) == b.argmax(-1)).mean() for a, b in zip(dense, candidate, strict=True)])
                pairs = list(zip(dense, candidate, strict=True))
                error = np.mean([np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in pairs])
                print(f"| {selection} | {verb} | {kept:.3f} | {steps:.3f} | {error:.3f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
