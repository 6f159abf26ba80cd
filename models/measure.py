"""Today's 2:4 figures of a reference model: dense vs magnitude vs calibrated conversion, on its evaluation set.

Magnitude is ``nmdeploy prune --eligible-only``; conversion is ``nmdeploy convert --calib CALIB --eligible-only``
with its defaults (sparsegpt, sequential fit) unless ``--fit parallel`` is given too; both run in-process on the
same exported model, side by side in one run. Prints one Markdown table; paste it under the model's section of
models/README.md with the date, the machine and ``uptime``.

    python models/measure.py textdet|textcls|mpnet|minilm [--fit sequential parallel] [--keep FOLDER]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from nmdeploy.cli import main as nmdeploy


@dataclass
class Subject:
    metric: str
    export: Callable[[Path], Path]
    write_calibration: Callable[[Path], object]
    evaluate: Callable[[Path, Path], float]  # (dense, candidate) -> task fidelity


def _textdet() -> Subject:
    from nmdeploy.reference import textdet

    evaluation = textdet.image_feeds(textdet.evaluation_images())
    dense_cache: dict[Path, np.ndarray] = {}

    def evaluate(dense: Path, candidate: Path) -> float:
        if dense not in dense_cache:
            dense_cache[dense] = textdet.detect_onnx(dense, evaluation)
        return textdet.mask_iou(dense_cache[dense], textdet.detect_onnx(candidate, evaluation))

    def export(folder: Path) -> Path:
        target = folder / "textdet.onnx"
        target.write_bytes(textdet.model_path().read_bytes())
        return target

    return Subject(
        "text-mask IoU (16 rendered-text images)",
        export,
        lambda folder: textdet.write_image_npz(textdet.calibration_images(), folder),
        evaluate,
    )


def _textcls() -> Subject:
    from nmdeploy.reference import textcls

    lines, _ = textcls.evaluation_lines()
    evaluation = textcls.line_feeds(lines)
    dense_cache: dict[Path, np.ndarray] = {}

    def evaluate(dense: Path, candidate: Path) -> float:
        if dense not in dense_cache:
            dense_cache[dense] = textcls.classify_onnx(dense, evaluation)
        return textcls.top1_agreement(dense_cache[dense], textcls.classify_onnx(candidate, evaluation))

    def export(folder: Path) -> Path:
        target = folder / "textcls.onnx"
        target.write_bytes(textcls.model_path().read_bytes())
        return target

    return Subject(
        f"top-1 agreement ({len(lines)} rendered text lines)",
        export,
        lambda folder: textcls.write_line_npz(textcls.calibration_lines()[0], folder),
        evaluate,
    )


def _sentences(module, name: str) -> Subject:
    evaluation = module.sentence_feeds(module.sentences("evaluation"))
    dense_cache: dict[Path, np.ndarray] = {}

    def evaluate(dense: Path, candidate: Path) -> float:
        from nmdeploy.reference import minilm

        if dense not in dense_cache:
            dense_cache[dense] = minilm.embed_onnx(dense, evaluation)
        return minilm.mean_cosine(dense_cache[dense], minilm.embed_onnx(candidate, evaluation))

    export = getattr(module, f"export_{name}_onnx")
    return Subject(
        f"mean embedding cosine ({sum(len(f['input_ids']) for f in evaluation)} evaluation sentences)",
        lambda folder: export(folder / f"{name}.onnx"),
        lambda folder: module.write_sentence_npz(module.sentences("calibration"), folder),
        evaluate,
    )


def subject(name: str) -> Subject:
    from nmdeploy.reference import minilm, mpnet

    if name == "textdet":
        return _textdet()
    if name == "textcls":
        return _textcls()
    if name == "mpnet":
        return _sentences(mpnet, "mpnet")
    if name == "minilm":
        return _sentences(minilm, "minilm")
    raise SystemExit(f"unknown model {name!r}; choose textdet, textcls, mpnet or minilm")


def _quiet(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = nmdeploy(argv)
    if code:
        raise SystemExit(f"nmdeploy {' '.join(argv)} exited {code}")
    return out.getvalue()


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _parameters(model: onnx.ModelProto) -> int:
    """Float values stored in initializers and Constant nodes (Paddle exports keep weights in the latter)."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    tensors = list(model.graph.initializer)
    tensors += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    return sum(int(np.prod(t.dims)) for t in tensors if t.data_type in floats)


def measure(name: str, fits: list[str], folder: Path) -> None:
    """Print the table row by row, so that a long run leaves every figure measured so far."""
    chosen = subject(name)
    dense = chosen.export(folder)
    chosen.write_calibration(folder / "calib")
    calibration_rows = sum(len(next(iter(np.load(f).values()))) for f in sorted((folder / "calib").glob("*.npz")))
    inspected = json.loads(_quiet(["inspect", "--json", str(dense)]))
    parameters = _parameters(onnx.load(str(dense), load_external_data=False))
    eligible = [w for w in inspected["weights"] if w["eligible"]]
    eligible_parameters = sum(int(np.prod(w["shape"])) for w in eligible)
    print(
        f"{name}: {parameters / 1e6:.2f} M parameters; {len(eligible)} TensorRT-eligible weights holding "
        f"{eligible_parameters / 1e6:.2f} M parameters ({eligible_parameters / parameters:.0%}); "
        f"{calibration_rows} calibration rows\n\n| model | {chosen.metric} | time (s) |\n|---|---|---|",
        flush=True,
    )
    print(f"| dense | {chosen.evaluate(dense, dense):.4f} | |", flush=True)
    start = time.perf_counter()
    _quiet(["prune", str(dense), "-o", str(folder / "magnitude.onnx"), "--eligible-only"])
    seconds = time.perf_counter() - start
    print(f"| magnitude 2:4 | {chosen.evaluate(dense, folder / 'magnitude.onnx'):.4f} | {seconds:.1f} |", flush=True)
    for fit in fits:
        out = folder / f"convert-{fit}.onnx"
        start = time.perf_counter()
        calibration = str(folder / "calib")
        _quiet(["convert", str(dense), "-o", str(out), "--calib", calibration, "--eligible-only", "--fit", fit])
        seconds = time.perf_counter() - start
        print(f"| convert sparsegpt {fit} | {chosen.evaluate(dense, out):.4f} | {seconds:.1f} |", flush=True)
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; peak RSS of this process {_peak_rss_gib():.1f} GiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=("textdet", "textcls", "mpnet", "minilm"))
    parser.add_argument("--fit", nargs="+", default=["sequential"], choices=("sequential", "parallel"))
    parser.add_argument("--keep", type=Path, help="work in this folder and keep the files")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        measure(args.model, args.fit, args.keep)
        return
    with tempfile.TemporaryDirectory() as folder:
        measure(args.model, args.fit, Path(folder))


if __name__ == "__main__":
    main()
