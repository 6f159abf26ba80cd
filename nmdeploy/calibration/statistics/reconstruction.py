"""Region reconstruction during sequential conversion: a few Adam steps on the converted weights of a stretch of
the model, masks fixed, so that its outputs on the converted model's inputs match the dense model's outputs.

Layer-wise fitting matches each layer's output to the dense one, but the errors of the layers of a block add up
inside it (attention mixes positions, the MLP's gate multiplies two converted outputs) in ways no layer's fit sees.
Fitting a whole stretch on its dense outputs, as block reconstruction does for decoders (separate attention and MLP
blocks, arXiv 2510.14444), repairs that. The stretches come from the plan the statistics engine already runs: a
*region* is a run of consecutive segments ending at a *clean cut*, one where every value that depends on a converted
weight is read by the next segment and no later. In a transformer the clean cuts fall between attention and MLP (or
at block ends), which is where the residual stream is all that carries the converted model forward.

What the region is trained toward follows the fit's target (:mod:`nmdeploy.passes.fit_target`): with ``"model"``,
the dense model's values leaving the region (the dense stream the engine runs beside the converted one); with
``"region"``, the region itself run with its dense weights on the converted inputs, the block-level form of each
layer matching its own dense outputs. On a decoder the second does not chase the earlier blocks' error on the
calibration text, and generalises better (SmolLM2-135M, 32 steps a region: perplexity 57.8 against 72.4 without
reconstruction; toward the dense model's values the gain was a fraction of that, BENCHMARKS.md).

The engine keeps, per calibration batch, the converted stream's values entering the region (and, for the model
target, the dense stream's values leaving it; for the region target, the dense weights the region reads); training
reads those, runs the region's nodes in the torch interpreter and updates the weights the region reads (pruned
entries' gradients zeroed, so they stay +0.0). The weights are written back only where the
error on the calibration batches fell, and the converted values leaving the region are then recomputed, so the
next segments (and their statistics) see the reconstructed model. The stage whose statistics close a region was
fitted on its inputs as they were before the reconstruction; its weights are read, and trained, in the next region.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from nmdeploy.calibration.statistics.segments import SegmentPlan
from nmdeploy.errors import InputError
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import to_numpy, to_torch
from nmdeploy.masks.distillation import relative_squared_error
from nmdeploy.runtimes.backends import backend_named
from nmdeploy.runtimes.torch import GRAPH_PRECISIONS, training_precision

# Measured on SmolLM2-135M, 32 steps a region: perplexity 65.6 at 1e-4, 61.9 at 3e-4, 57.8 at 1e-3, 63.5 at 3e-3.
DEFAULT_LR = 1e-3
DEFAULT_ROWS = 4  # calibration rows per Adam step
EVALUATION_ROWS = 16  # rows per run when measuring the error and recomputing the outputs (bounds activation memory)
TARGETS = ("model", "region")  # what a region is trained toward: the dense model's values, or its own dense run


@dataclass(frozen=True)
class ReconstructionOptions:
    """``steps`` Adam steps per region at learning rate ``lr``, each on ``rows`` calibration rows drawn at random
    (a whole batch where its values cannot be cut into rows), toward ``target`` (one of :data:`TARGETS`); a region
    spans ``span`` consecutive stretches between clean cuts (2 on a transformer: attention and MLP, one block).
    ``precision`` of the training steps' products (:func:`~nmdeploy.runtimes.torch.training_precision`: "auto" is
    bfloat16 where the device multiplies it natively); weights, Adam's state and the error measured stay float32."""

    steps: int
    lr: float = DEFAULT_LR
    rows: int = DEFAULT_ROWS
    target: str = "model"
    span: int = 1
    precision: str = "float32"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InputError(f"--reconstruct takes a number of steps of at least 1, got {self.steps}")
        if self.rows < 1:
            raise InputError(f"reconstruction steps take at least one row, got {self.rows}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"--reconstruct-lr must be a positive number, not {self.lr}")
        if self.span < 1:
            raise InputError(f"--reconstruct-span takes a number of regions of at least 1, got {self.span}")
        if self.precision not in ("auto", *GRAPH_PRECISIONS):
            raise InputError(f"reconstruction precision {self.precision!r}: one of auto, {', '.join(GRAPH_PRECISIONS)}")
        if self.target not in TARGETS:
            raise ValueError(f"reconstruction target {self.target!r}: one of {', '.join(TARGETS)}")


@dataclass
class Region:
    """Segments ``first``..``last`` of a plan: the weights they read (``weights``), the values they read from
    before them (``inputs``), the values depending on converted weights that they leave to later segments
    (``outputs``), and their nodes and constant initializers."""

    first: int
    last: int
    weights: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    initializers: list[str] = field(default_factory=list)


@dataclass
class RegionResult:
    """One region's relative output error on the calibration batches before and after, and whether the trained
    weights were kept (only where the error fell)."""

    first: int
    last: int
    weights: int
    error_before: float
    error_after: float
    kept: bool
    seconds: float


def clean_cuts(plan: SegmentPlan) -> list[int]:
    """The segments after which every value depending on a fed weight is read by the next segment only."""
    cuts = []
    for k in range(len(plan.segments)):
        crossing = [name for name in plan.live_after(k) if name in plan.tainted]
        if all(plan.last_need[name] == k + 1 for name in crossing):
            cuts.append(k)
    return cuts


def reconstruction_regions(plan: SegmentPlan, span: int = 1) -> list[Region]:
    """The regions between consecutive clean cuts that read at least one fed weight and leave a value behind; with
    ``span`` > 1, each ``span`` consecutive such regions joined into one (the stretches between them included)."""
    regions, first = [], 0
    for last in clean_cuts(plan):
        region = _region(plan, first, last)
        if region.weights and region.outputs:
            regions.append(region)
        first = last + 1
    if span == 1:
        return regions
    groups = [regions[start : start + span] for start in range(0, len(regions), span)]
    return [_region(plan, group[0].first, group[-1].last) for group in groups]


def _region(plan: SegmentPlan, first: int, last: int) -> Region:
    """Segments ``first``..``last`` (``last`` a clean cut) as a region."""
    region = Region(first, last)
    for segment in plan.segments[first : last + 1]:
        region.nodes += segment.nodes
        region.weights += [name for name in segment.weights if name not in region.weights]
        region.initializers += [name for name in segment.initializers if name not in region.initializers]
        region.inputs += [name for name in segment.inputs if plan.made_in[name] < first and name not in region.inputs]
    region.outputs = [
        name
        for name in plan.live_after(last)
        if name in plan.tainted and first <= plan.made_in[name] <= last and name not in plan.fed
    ]
    return region


def _tensor(value: object, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        # Values the torch runner made under inference_mode cannot enter autograd: a plain copy can.
        return value.clone().to(device) if value.is_inference() else value.to(device)
    array = np.ascontiguousarray(value)
    return to_torch(array).reshape(array.shape).to(device)


def _relative_error(outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over the outputs of the squared error relative to the dense value's energy."""
    return torch.stack([relative_squared_error(outputs[name], target) for name, target in targets.items()]).mean()


class _Piece:
    """One calibration batch's region inputs and dense targets, cut into row chunks where every target leads with
    the same row count (a decoder's [batch, sequence, hidden]); values of that leading size with two or more axes
    are cut with them (masks, ids), the rest (rotary tables, shapes) are given whole."""

    def __init__(self, inputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]):
        self.inputs, self.targets = inputs, targets
        leading = {t.shape[0] if t.ndim >= 2 else -1 for t in targets.values()}
        self.rows = leading.pop() if len(leading) == 1 and -1 not in leading else 1
        self.cut = [
            name for name, value in {**inputs, **targets}.items() if value.ndim >= 2 and value.shape[0] == self.rows
        ]

    def take(self, rows: torch.Tensor | slice | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if rows is None or self.rows == 1:
            return self.inputs, self.targets
        cut = set(self.cut)
        inputs = {name: value[rows] if name in cut else value for name, value in self.inputs.items()}
        return inputs, {name: value[rows] for name, value in self.targets.items()}

    def chunks(self, size: int) -> list[slice | None]:
        if self.rows == 1:
            return [None]
        return [slice(start, start + size) for start in range(0, self.rows, size)]


def reconstruct_region(
    model: OnnxModel,
    region: Region,
    weight_protos: dict[str, onnx.TensorProto],
    batches: Sequence[int],
    read: Callable[[int, str, bool], object],
    write: Callable[[int, str, torch.Tensor], None],
    options: ReconstructionOptions,
    device: torch.device,
    dense_weights: Mapping[str, object] | None = None,
) -> RegionResult:
    """Train ``region``'s float32 weights on the calibration ``batches`` and write them to ``model`` if the error
    fell; ``read(batch, name, dense)`` gives a stored value (the dense stream's, or the converted one's), ``write``
    stores a recomputed converted output. The region target needs ``dense_weights``: the region's weights as they
    were before conversion."""
    start = time.perf_counter()
    main = model.index.main
    proto = onnx.ModelProto(ir_version=model.proto.ir_version)
    proto.opset_import.extend(model.proto.opset_import)
    proto.graph.node.extend(main.nodes[position] for position in region.nodes)
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in region.outputs)
    wanted = set(region.initializers)
    constants = {tensor.name: model.read(tensor) for tensor in model.proto.graph.initializer if tensor.name in wanted}
    stored = {name: model.read(weight_protos[name]) for name in region.weights}
    trained = [name for name, value in stored.items() if np.asarray(value).dtype == np.float32]
    # The weights not trained (not float32) are constants of the region, moved to the device once with the others.
    constants.update((name, value) for name, value in stored.items() if name not in trained)
    label = f"the region of stages {region.first}-{region.last}"
    torch_backend = backend_named("torch")
    program = torch_backend.open_graph(proto, constants, device=str(device), label=label, differentiable=True)
    precision = training_precision(options.precision, device)
    training = program
    if precision != "float32":
        training = torch_backend.open_graph(
            proto, constants, device=str(device), label=label, differentiable=True, precision=precision
        )
    parameters = {name: _tensor(stored[name], device).clone().requires_grad_(True) for name in trained}
    kept = {name: (p.detach() != 0).to(p.dtype) for name, p in parameters.items()}
    for name, parameter in parameters.items():
        # A zero gradient keeps Adam's moments and step at zero: pruned entries stay +0.0.
        parameter.register_hook(lambda grad, mask=kept[name]: grad * mask)
    toward_region = options.target == "region"
    if toward_region and dense_weights is None:
        raise ValueError("the region target needs the region's dense weights")
    pieces = [
        _Piece(
            {name: _tensor(read(b, name, False), device) for name in region.inputs},
            # Toward the region's own dense run, the converted outputs stand in until the cut into rows is known:
            # they have the targets' shapes.
            {name: _tensor(read(b, name, not toward_region), device).float() for name in region.outputs},
        )
        for b in batches
    ]

    def run(values: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return program.run({**values, **inputs})

    current = {name: p.detach() for name, p in parameters.items()}
    for piece in pieces:
        # Shapes computed from the batch size upstream (a Reshape's target) or a leading axis that only happens to
        # equal the row count (a [sequence, sequence] mask) break the cut: such a batch trains whole.
        for size in {min(options.rows, piece.rows), min(EVALUATION_ROWS, piece.rows)}:
            if piece.rows == 1 or size == piece.rows:
                continue
            inputs, targets = piece.take(slice(0, size))
            try:
                with torch.no_grad():
                    outputs = run(current, inputs)
                cut = all(outputs[name].shape == target.shape for name, target in targets.items())
            except (RuntimeError, IndexError, ValueError):
                cut = False
            if not cut:
                piece.rows = 1

    if toward_region:
        dense = {name: _tensor(dense_weights[name], device) for name in trained}
        with torch.no_grad():
            for piece in pieces:
                made = [run(dense, piece.take(rows)[0]) for rows in piece.chunks(EVALUATION_ROWS)]
                piece.targets = {name: torch.cat([chunk[name] for chunk in made]).float() for name in region.outputs}

    def error(values: dict[str, torch.Tensor]) -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            for piece in pieces:
                for rows in piece.chunks(EVALUATION_ROWS):
                    inputs, targets = piece.take(rows)
                    total += float(_relative_error(run(values, inputs), targets))
                    count += 1
        return total / count

    before = error({name: p.detach() for name, p in parameters.items()})
    if parameters:
        generator = torch.Generator().manual_seed(0)
        # Each step one mini-batch of rows from a batch drawn in proportion to its rows.
        weights = torch.tensor([float(piece.rows) for piece in pieces])
        optimizer = torch.optim.Adam(parameters.values(), lr=options.lr)
        for _ in range(options.steps):
            piece = pieces[int(torch.multinomial(weights, 1, generator=generator))]
            rows = torch.randperm(piece.rows, generator=generator)[: options.rows]
            inputs, targets = piece.take(rows.sort().values)
            loss = _relative_error(training.run({**parameters, **inputs}), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.mul_(kept[name])  # +0.0 exactly where pruned
    values = {name: p.detach() for name, p in parameters.items()}
    after = error(values) if parameters else before
    keep = after < before
    if keep:
        for name, value in values.items():
            original = stored[name]
            model.write(weight_protos[name], to_numpy(value.to("cpu").contiguous(), original))
        with torch.no_grad():
            for batch, piece in zip(batches, pieces, strict=True):
                made = [run(values, piece.take(rows)[0]) for rows in piece.chunks(EVALUATION_ROWS)]
                for name in region.outputs:
                    write(batch, name, torch.cat([chunk[name] for chunk in made]))
    return RegionResult(
        region.first,
        region.last,
        len(parameters),
        before,
        after if keep else before,
        keep,
        time.perf_counter() - start,
    )
