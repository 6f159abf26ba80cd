"""The digits CNN as the conversion benchmarks use it: trained with a fixed seed, exported, calibrated on 512
training images, and judged by test accuracy in ONNX Runtime (benchmarks/convert.py and benchmarks/recover.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nmdeploy.reference import digits

CALIBRATION_IMAGES = 512


@dataclass(frozen=True)
class DigitsBench:
    model: Path  # the dense export
    calibration: Path  # a folder of .npz batches of training images
    dense_accuracy: float  # of the trained torch model on the test split
    accuracy: Callable[[Path], float]  # test accuracy of an ONNX file in ONNX Runtime


def digits_bench(work: Path) -> DigitsBench:
    """Train (seed 0), export to ``work/digits.onnx`` and write the calibration batches under ``work``."""
    splits = digits.digits_splits(0)
    model = digits.DigitsCNN(seed=0)
    dense_accuracy = digits.train_digits(model, splits)
    model_path = digits.export_digits_onnx(model, work / "digits.onnx")
    calibration = work / "digits-calib"
    digits.digits_npz(splits.train_x[:CALIBRATION_IMAGES], calibration, batch=128)
    test = {digits.INPUT_NAME: splits.test_x.numpy()}

    def accuracy(path: Path) -> float:
        from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

        with OnnxRuntimeRunner(path) as runner:
            logits = runner.infer(test)[digits.OUTPUT_NAME]
        return float((logits.argmax(axis=1) == splits.test_y.numpy()).mean())

    return DigitsBench(model_path, calibration, dense_accuracy, accuracy)
