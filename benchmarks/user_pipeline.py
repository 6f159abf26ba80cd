"""The user-model pipeline's wall time, step by step, on a 17M-parameter sentence encoder with 256-row data.

The encoder is the test fixture (tests/encoder_model.py: token embedding, MatMul/Relu/MatMul with a residual,
LayerNorm, masked mean, L2 normalisation) at a real encoder's sizes: 30522 x 512 token embeddings, a 512 -> 1024 ->
512 block, 16 tokens per sentence (16.7M parameters). ``nmdeploy pipeline MODEL --calib C --data E`` runs in-process
on whatever ``nmdeploy`` the interpreter imports, so the same script times two versions (PYTHONPATH=...):

    python benchmarks/user_pipeline.py [--rows 256]

It prints the whole run's seconds and each step's, as the pipeline logs them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import encoder_model  # noqa: E402

import nmdeploy  # noqa: E402
from nmdeploy.cli import main  # noqa: E402

VOCABULARY, WIDTH, HIDDEN, TOKENS = 30522, 512, 1024, 16


def build(folder: Path, rows: int) -> tuple[Path, Path, Path]:
    encoder_model.WIDTH, encoder_model.HIDDEN, encoder_model.TOKENS = WIDTH, HIDDEN, TOKENS
    encoder_model.VOCABULARY = VOCABULARY
    model = encoder_model.save_encoder(folder / "encoder.onnx", vocabulary=VOCABULARY)
    calib, evaluation = folder / "calib.npz", folder / "eval.npz"
    np.savez(calib, **encoder_model.token_batch(np.random.default_rng(1), rows))
    np.savez(evaluation, **encoder_model.token_batch(np.random.default_rng(2), rows))
    return model, calib, evaluation


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="calibration and evaluation rows (256)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model, calib, evaluation = build(Path(folder), args.rows)
        log = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            argv = ["pipeline", str(model), "--calib", str(calib), "--data", str(evaluation), "-o", f"{folder}/out"]
            code = main(argv)
        seconds = time.perf_counter() - started
        batch = re.search(r"^batch = (\[.*\])$", (Path(folder) / "out" / "baselines.toml").read_text(), re.M)
    steps = re.findall(r"^\S+: (.+) done in ([\d.]+) s$", log.getvalue(), re.M)
    print(f"nmdeploy {nmdeploy.__version__} from {Path(nmdeploy.__file__).parent}: exit {code}, {seconds:.1f} s")
    print("timed batch sizes:", batch.group(1) if batch else "?")
    for step, taken in steps:
        print(f"  {step}: {taken} s")


if __name__ == "__main__":
    main_()
