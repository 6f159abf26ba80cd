"""Calibration and evaluation sets for a user's own ONNX model: text through a tokenizer, image files, or a
data-loader function, written as one folder of .npz shards that every verb's ``--data``/``--calib`` reads."""

from nmdeploy.runtimes.datasets.hook import build_hook_set
from nmdeploy.runtimes.datasets.images import build_image_set
from nmdeploy.runtimes.datasets.shards import DataSetReport
from nmdeploy.runtimes.datasets.text import build_text_set

__all__ = ["DataSetReport", "build_hook_set", "build_image_set", "build_text_set"]
