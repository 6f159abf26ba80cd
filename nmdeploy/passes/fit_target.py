"""What the sequential fit asks each layer to match (the dense model's outputs, or the layer's own) and how much it
damps its statistics, where language models and other models differ.

In a sequential fit every layer sees the inputs of the model converted so far, X~ instead of the dense X. Two targets
are then possible:

- ``model``: the dense model's outputs at that layer, X W^T. Fitting toward them also corrects, on the calibration
  rows, the error the layers before it left (:func:`nmdeploy.masks.shifted_target`); it needs the dense model run
  beside the converted one and the cross moments X~^T X.
- ``layer``: the layer's own dense outputs on the converted inputs, X~ W^T, as SparseGPT and llm-compressor fit. Each
  layer reproduces itself; nothing is corrected on behalf of earlier layers.

Which one transfers better to data the fit never saw depends on the model, measured (BENCHMARKS.md, docs/convert.md):
on MiniLM-L6 (6 encoder layers) ``model`` is ahead on its own kind of text and on another (held-out cosine 0.902 /
0.794 against 0.878 / 0.777); on SmolLM2-135M (30 decoder blocks) ``layer`` is far ahead on text of another source
(perplexity 71.8 against 83.4, dense 14.7): over 30 blocks the corrections fit the calibration text rather than the
model. ``auto`` therefore takes ``layer`` for language models (an output of scores over a token vocabulary) and
``model`` otherwise. Two of three real decoder families judged on text of another source back that choice: on
Qwen2.5-Coder-0.5B ``layer`` is ahead too (34.7 against 42.6), while Gemma 3 270M goes the other way (``model`` 104.7
against ``layer`` 145.9, dense 34.8). On the tests' tiny random decoder, calibrated and judged on the same
random-token distribution, ``model`` is ahead (next-token KL 0.040 against 0.049 with sparsegpt), so
``--fit-target model`` suits a decoder whose deployment text is the calibration text's kind.

The damping (a ridge relative to the mean of diag(X^T X)) is the other choice that differs: measured on three decoder
families, 64 x 256 calibration tokens, perplexity on text of another source (BENCHMARKS.md), 0.03 beats both 0.1 and
llm-compressor's 0.01 on each: SmolLM2-135M 69.9 (0.1: 72.4, 0.01: 74.4), Qwen2.5-Coder-0.5B 33.1 (34.7, 34.3),
Gemma 3 270M 123.5 (145.9, 129.9); on MiniLM-L6 0.1 is ahead of 0.01, 0.3 and 1.0. So language models are damped
0.03 by default and other models 0.1.
"""

from __future__ import annotations

from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.outputs import vocabulary_outputs

FIT_TARGETS = ("model", "layer")
DEFAULT_DAMPING, LANGUAGE_MODEL_DAMPING = 0.1, 0.03


def fit_target(model: OnnxModel, choice: str = "auto") -> str:
    """``choice`` with ``auto`` resolved for ``model``: ``layer`` for a language model, else ``model``."""
    if choice != "auto":
        return choice
    return "layer" if is_language_model(model) else "model"


def fit_damping(model: OnnxModel, choice: float | None = None) -> float:
    """``choice``, or where None the default for ``model``: 0.03 for a language model, else 0.1."""
    if choice is not None:
        return choice
    return LANGUAGE_MODEL_DAMPING if is_language_model(model) else DEFAULT_DAMPING


def is_language_model(model: OnnxModel) -> bool:
    """Whether an output of ``model`` scores the token vocabulary (:func:`vocabulary_outputs`)."""
    return bool(vocabulary_outputs(model.proto, model.index))
