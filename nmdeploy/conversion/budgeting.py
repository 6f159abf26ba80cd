"""What both budgets share (:mod:`nmdeploy.conversion.budget`, 2:4 or dense per layer, and
:mod:`nmdeploy.conversion.precision_budget`, 2:4 and precision per layer): the held-out probe that measures a
candidate's fidelity in ONNX Runtime, the ``include`` pattern naming exactly the chosen layers, and the loop that
builds the chosen set, measures it and backs off while it falls short of the floor."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx

from nmdeploy.fidelity import FidelityMetric, Figure, measure, select_outputs
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.outputs import classifier_outputs, output_batch_axes, with_model_blank

Built = TypeVar("Built")


def exact_names(names: Sequence[str]) -> str:
    """The ``include`` regular expression that selects exactly the weights ``names``."""
    return "^(" + "|".join(re.escape(name) for name in names) + ")$"


class HeldOutProbe:
    """ONNX Runtime on one copy of the dense model whose candidate weights ``names`` are overridable inputs: the
    dense outputs on the held-out ``batches`` once, then any candidate's fidelity to them (weights swapped in by
    :meth:`measure`, or a whole model by :meth:`measure_model`)."""

    def __init__(
        self,
        model: OnnxModel,
        names: Sequence[str],
        batches: list[dict[str, np.ndarray]],
        folder: Path,
        outputs: Sequence[str] | None = None,
        user_metric: bool = False,
    ):
        from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

        probe = copy.deepcopy(model)
        graph = probe.proto.graph
        # Weights held by Constant nodes become initializers of the same name, so that they can be fed too.
        for node in [n for n in graph.node if n.op_type == "Constant" and n.output[0] in names]:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                tensor = onnx.TensorProto()
                tensor.CopyFrom(value)
                tensor.name = node.output[0]
                graph.initializer.append(tensor)
                graph.node.remove(node)
        initializers = {t.name: t for t in graph.initializer}
        listed = {value.name for value in graph.input}
        for name in names:
            if name not in listed:
                tensor = initializers[name]
                graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
        self.batches = batches
        self.runner = OnnxRuntimeRunner(probe.save(folder / "probe.onnx")).__enter__()
        self.dense = [self.runner.infer(batch) for batch in batches]
        self.selection = select_outputs(self.dense[0], batches[0], outputs, required=not user_metric)
        self.classifiers = classifier_outputs(model.proto)
        self.batch_axes = output_batch_axes(model.proto)
        self.model = model.proto
        self.figures: list[Figure] = []  # each judged output's figure in the last measurement

    def _fidelity(self, candidates: list[dict[str, np.ndarray]], metric: FidelityMetric) -> float:
        batches = zip(self.dense, candidates, self.batches, strict=True)
        metric = with_model_blank(metric, self.model)
        meter = measure(batches, metric, self.selection.judged, self.classifiers, self.batch_axes)
        self.figures = meter.figures()
        return meter.value()

    def measure(self, overrides: dict[str, np.ndarray], metric: FidelityMetric) -> float:
        """Fidelity of the dense model with the weights ``overrides`` swapped in."""
        return self._fidelity([self.runner.infer({**batch, **overrides}) for batch in self.batches], metric)

    def measure_model(self, path: Path, metric: FidelityMetric) -> float:
        """Fidelity of the model saved at ``path``."""
        from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

        with OnnxRuntimeRunner(path) as runner:
            candidates = [runner.infer(batch) for batch in self.batches]
        return self._fidelity(candidates, metric)


def verify_and_back_off(
    build: Callable[[], Built],
    measure: Callable[[Built], float],
    back_off: Callable[[float], bool],
    describe: Callable[[], dict[str, Any]],
    min_fidelity: float,
) -> tuple[Built, float, list[dict[str, Any]]]:
    """Build the chosen set (``build``), measure it, and while it falls short of ``min_fidelity`` let ``back_off``
    undo upgrades and build again; ``back_off`` gets the measured fidelity and returns False when nothing is left
    to try. Returns the last build, its measured fidelity and every attempt (``describe()`` of the set built, with
    its ``fidelity``); the caller judges a last build still below the floor."""
    attempts: list[dict[str, Any]] = []
    while True:
        built = build()
        measured = measure(built)
        attempts.append({**describe(), "fidelity": measured})
        if measured >= min_fidelity or not back_off(measured):
            return built, measured, attempts
