"""Per-model preparation: export each reference model with its calibration and evaluation batches, or describe a
user's model and data as they are; every later step reads only the PreparedModel."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.runtimes.shapes import ShapeRange

PATTERN = "2:4"
DENSE = "dense.onnx"
CONVERTED = "converted-2of4.onnx"
CAST = "converted-2of4-fp16.onnx"
PRECISIONS = ("fp16", "int8", "fp8")
"""What the pipeline deploys: the fp16 cast, or INT8 / FP8 Q/DQ on the 2:4 model (the quantize step of the recipes
tensorrt-2of4-int8 / tensorrt-2of4-fp8, or the precision budget with a fidelity floor)."""
CALIBRATION = "calibration"
EVALUATION = "evaluation"
BASELINES = "baselines.toml"


def quantized_name(precision: str) -> str:
    """The file the quantize step writes for ``precision`` (int8 or fp8)."""
    return f"converted-2of4-{precision}.onnx"


def engine_name(precision: str) -> str:
    return f"converted-2of4-{precision}.engine"


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return precision


@dataclass(frozen=True)
class PreparedModel:
    """A dense model and its calibration and evaluation data (a bundled model exported into its folder, with the
    batches beside it; a user's model where it lies), and ``folder`` that receives the pipeline's artefacts."""

    name: str
    folder: Path
    dense: Path
    calibration: Path
    evaluation: Path
    convert_include: str | None  # which weights the conversion targets (None: every prunable weight)
    engine_shapes: dict[str, ShapeRange]  # TensorRT optimisation profile: input name -> (min, opt, max)
    single_thread: bool  # a small model: torch threads only add synchronisation
    labelled: tuple[np.ndarray, np.ndarray] | None = None  # held-out inputs and labels, for task accuracy
    convert_exclude: str | None = None  # weights the conversion leaves dense


def prepare_digits(folder: Path) -> PreparedModel:
    """Train the digits CNN (seeded, one thread, seconds) and export it with 512 calibration and 450 test images."""
    from nmdeploy.reference.digits import DigitsCNN, digits_npz, digits_splits, export_digits_onnx, train_digits

    splits = digits_splits(seed=0)
    model = DigitsCNN(seed=0)
    train_digits(model, splits, seed=0)
    dense = export_digits_onnx(model, folder / DENSE)
    calibration, evaluation = _fresh_folder(folder / CALIBRATION), _fresh_folder(folder / EVALUATION)
    digits_npz(splits.train_x[:512], calibration, batch=64)
    digits_npz(splits.test_x, evaluation, batch=150)
    return PreparedModel(
        "digits",
        folder,
        dense,
        calibration,
        evaluation,
        convert_include=None,
        engine_shapes={"image": ((1, 1, 8, 8), (64, 1, 8, 8), (256, 1, 8, 8))},
        single_thread=True,
        labelled=(splits.test_x.numpy(), splits.test_y.numpy()),
    )


def prepare_minilm(folder: Path) -> PreparedModel:
    """Export the pretrained MiniLM encoder and tokenise the calibration and evaluation sentences (32 per batch)."""
    from nmdeploy.reference import minilm

    with warnings.catch_warnings():
        # The exporter's note on negative indices of aten::index: the indices here come from the attention mask.
        warnings.filterwarnings("ignore", message="Exporting aten::index", category=UserWarning)
        dense = minilm.export_minilm_onnx(folder / DENSE)
    calibration, evaluation = _fresh_folder(folder / CALIBRATION), _fresh_folder(folder / EVALUATION)
    minilm.write_sentence_npz(minilm.sentences("calibration"), calibration)
    minilm.write_sentence_npz(minilm.sentences("evaluation"), evaluation)
    profile = ((1, 16), (32, 64), (64, 128))
    return PreparedModel(
        "minilm",
        folder,
        dense,
        calibration,
        evaluation,
        # The 36 Linear weights of the six encoder blocks; the exporter names their MatMuls /bert/encoder/...
        convert_include="encoder",
        engine_shapes={name: profile for name in minilm.INPUT_NAMES},
        single_thread=False,
    )


def user_model(
    dense: Path,
    calibration: Path,
    evaluation: Path,
    folder: Path,
    *,
    include: str | None = None,
    exclude: str | None = None,
) -> PreparedModel:
    """A user's ONNX model and data, read where they are (nothing is copied); artefacts go to ``folder``."""
    return PreparedModel(
        dense.stem,
        folder,
        dense,
        calibration,
        evaluation,
        convert_include=include,
        engine_shapes={},  # TensorRT's own profile from the model's shapes
        single_thread=False,
        convert_exclude=exclude,
    )


PREPARE: dict[str, Callable[[Path], PreparedModel]] = {"digits": prepare_digits, "minilm": prepare_minilm}


def _fresh_folder(folder: Path) -> Path:
    """An empty batch folder: stale batches of an earlier run would otherwise be read as data."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("batch-*.npz"):
        stale.unlink()
    return folder
