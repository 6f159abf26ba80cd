"""The order weights are fitted in: stages such that no weight's GEMM input depends on a weight of its own stage or
a later one, so each stage's statistics can be taken on the model converted up to it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx

from nmdeploy.calibration.statistics.taps import consumer
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight


def fitting_stages(model: OnnxModel, weights: Sequence[PrunableWeight]) -> list[list[PrunableWeight]]:
    """The weights in stages such that no weight's GEMM input depends on a weight of its own or a later stage.

    Fitting stage by stage, each on statistics from the model converted so far, lets every layer see the inputs
    it will see after conversion; weights side by side (a transformer's Q, K and V) share a stage and one run.
    Weights that cannot be tapped go in the first stage, where collection reports them.
    """
    index = model.index
    main = index.main
    position = {id(node): at for at, node in enumerate(main.nodes)}
    weight_at = {
        position[id(node)]: weight.name
        for weight, node in weight_consumers(model, weights).items()
        if not isinstance(node, str)
    }
    deepest: dict[int, int] = {}  # node -> the latest stage among the weights at or above it
    level: dict[str, int] = {}
    for at in index.topological_order():
        depth = max((deepest[main.producers[name]] for name in main.reads(at) if name in main.producers), default=-1)
        if at in weight_at:
            depth += 1
            level[weight_at[at]] = depth
        deepest[at] = depth
    stages: dict[int, list[PrunableWeight]] = {}
    for weight in weights:
        stages.setdefault(level.get(weight.name, 0), []).append(weight)
    return [stages[key] for key in sorted(stages)]


def weight_consumers(model: OnnxModel, weights: Iterable[PrunableWeight]) -> dict[PrunableWeight, onnx.NodeProto | str]:
    """Each weight's one consuming node in the main graph, or why there is not exactly one."""
    main = model.index.main
    return {weight: consumer(weight, main.positions) for weight in weights}
