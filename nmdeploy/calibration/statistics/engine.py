"""Statistics stage by stage, each segment of the model run once per stream over the calibration batches.

Stage k's GEMM inputs never depend on stage k's weights (that is how the stages are cut), so its statistics come
from running segment k before the stage is fitted: H~ = X~^T X~ on the converted stream, and, once earlier weights
have changed, the cross moments X~^T X against the dense stream. The caller then writes the stage's weights, and the
next segment runs on the values the converted stream left at the cut. Every batch's boundary values live in a
:class:`SpillStore`: values that no converted weight reaches are kept once for both streams, the rest once per
stream, and everything past the memory limit goes to disk. A run of S stages therefore costs one pass of the model
per stream, whatever S is, and memory holds one batch's activations plus the cut.

The segments run through the backend registry (:mod:`nmdeploy.runtimes.backends`, chosen by its graph engine name):
ONNX Runtime on the CPU, or (``runner="torch"``) the torch interpreter on a device. A backend that keeps values on
its device keeps the boundary values there too (counted against the same memory limit, spilled to host disk past
it), and the moments are accumulated there.

Across processes (``ranks``, :mod:`nmdeploy.calibration.distributed`) each rank runs its share of every batch's rows
and the stage's moments are summed over the ranks before the stage is yielded.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nmdeploy.calibration.statistics.reconstruction import (
    ReconstructionOptions,
    Region,
    RegionResult,
    reconstruct_region,
    reconstruction_regions,
)
from nmdeploy.calibration.statistics.segments import SegmentPlan, SegmentSession
from nmdeploy.calibration.statistics.stages import weight_consumers
from nmdeploy.calibration.statistics.store import SpillStore
from nmdeploy.calibration.statistics.taps import (
    InputStatistics,
    Tap,
    accumulate,
    as_matrix,
    find_tap,
    reduction_length,
)
from nmdeploy.errors import InputError, first_line
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.tensors import to_torch
from nmdeploy.masks.blockwise import BlockDiagonal
from nmdeploy.masks.memory import LayerShape, StatisticsPlan, plan_statistics, statistics_itemsize
from nmdeploy.runtimes.backends import graph_backend, graph_engines
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes
from nmdeploy.runtimes.data import graph_inputs

if TYPE_CHECKING:
    from nmdeploy.calibration.distributed import Ranks

DEFAULT_CACHE_LIMIT = 1 << 30  # bytes of boundary values and dense weights kept in memory before spilling to disk
# Bytes the first segment may return for one run. A segment that taps many layers at once (parallel fitting: the
# whole model) returns every tapped GEMM input of the batch together, so batches are cut into pieces of this size.
# What a run holds inside later segments is many times what crosses the cuts (a decoder block's attention scores and
# MLP activations), so pieces are kept small: on SmolLM2-135M with 64 x 256 tokens, pieces of 16 MB peaked at 1.3 GB
# RSS where 256 MB (one piece) peaked at 2.4 GB, in the same time or less.
DEFAULT_RUN_LIMIT = 1 << 24

_SHARED, _CONVERTED, _DENSE = "shared", "converted", "dense"
_STATISTICS_DTYPES = {8: torch.float64, 4: torch.float32}
RUNNERS = graph_engines()  # the backends that run segments, by the names --statistics gives them


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; other C libraries have none
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system after a stage. glibc keeps what a stage's runs freed (ONNX
    Runtime's outputs, the statistics, the fit's copies) for reuse, and on Qwen2.5-0.5B that grew by 28-338 MB over
    the first six stages, raising the peak block after block; later stages allocate other sizes and reuse little."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass
class CalibrationSummary:
    """What a calibration run cost: batches and samples read, segments run, memory kept and spilled."""

    batches: int = 0  # batches of calibration data read
    samples: int = 0  # entries along the inputs' first axis
    pieces: int = 0  # runs of the first segment: batches, or their pieces where one batch's values would be too large
    segments: int = 0
    segment_runs: int = 0
    seconds: float = 0.0
    cached_peak_bytes: int = 0
    spilled_bytes: int = 0
    regions: list[RegionResult] | None = None  # with reconstruction: the regions reconstructed, in order

    @property
    def spilled(self) -> bool:
        return self.spilled_bytes > 0


def _samples(batch: dict[str, np.ndarray], axes: BatchAxes) -> int:
    """Rows of the batch along its inputs' batch axes as the graph gives them (1 where none has one, as for scalars
    alone, or where the data's axes were given otherwise: the count is only reported and paces the pieces)."""
    try:
        return axes.rows(batch, "calibration batch")
    except InputError:
        return 1


def _to_device(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """A calibration batch as tensors on ``device``, moved once when read."""
    from nmdeploy.graph.tensors import to_torch

    return {name: to_torch(array).reshape(array.shape).to(device, non_blocking=True) for name, array in batch.items()}


def _output_width(weight: PrunableWeight) -> int:
    """The number of outputs of the weight's GEMM (rows of its [out, K] matrix)."""
    if weight.uses[0].op_type == "Conv":
        return weight.shape[0]
    return math.prod(weight.shape) // weight.shape[weight.axis]  # a recurrent W stacks directions and gates


def _dense_matrix(model: OnnxModel, weight: PrunableWeight) -> torch.Tensor:
    """The weight as it is in the model now (dense: its stage is not fitted yet), as its [out, K] GEMM matrix."""
    values = to_torch(model.read(weight.tensor))
    return as_matrix(weight, values.to(torch.float32 if values.dtype != torch.float64 else torch.float64)).contiguous()


class StageStatistics:
    """Iterate over ``stages``, yielding (stage, statistics by weight name, skipped weight -> reason) per stage.

    Between two yields the caller converts the stage's weights in ``model``: the next stage's statistics are taken
    on the model as it is then. ``compare_dense`` runs the dense model beside the converted one wherever their values
    differ and, with ``shift_targets``, collects the cross moments against it there (the fit then matches the dense
    model's outputs rather than each layer's own on the converted inputs). ``batches`` is read once. ``runner``: the
    graph engine of the backend that runs the segments, "onnxruntime" (CPU) or "torch" (the torch interpreter on
    ``device``, where the moments are accumulated too). ``observers`` maps activation names to a function called
    with each batch's value of that activation, as the first segment computes it (quantization's range statistics);
    the first segment then also computes those values. ``ranks``: this process runs its share of the rows, and each
    stage's moments are summed over all ranks (every rank's model must be converted alike between stages).
    ``reconstruction``: after the stage that closes each region of the plan (:mod:`.reconstruction`), the weights
    the region reads are trained toward the dense stream's outputs (target "model": sequential runs comparing with
    the dense model) or toward the region run with its dense weights (target "region"), in one process.
    """

    def __init__(
        self,
        model: OnnxModel,
        stages: Sequence[Sequence[PrunableWeight]],
        batches: Iterable[dict[str, np.ndarray]],
        *,
        compare_dense: bool = True,
        shift_targets: bool = True,
        cache_limit: int = DEFAULT_CACHE_LIMIT,
        run_limit: int = DEFAULT_RUN_LIMIT,
        runner: str = "onnxruntime",
        device: str = "cpu",
        observers: Mapping[str, Callable[[np.ndarray | torch.Tensor], None]] | None = None,
        memory_budget: int | None = None,
        group_size: int = 4,
        ranks: Ranks | None = None,
        reconstruction: ReconstructionOptions | None = None,
    ):
        if runner not in graph_engines():
            raise ValueError(f"statistics runner {runner!r}: one of {', '.join(graph_engines())}")
        self.backend = graph_backend(runner)
        if torch.device(device).type not in self.backend.devices:
            raise ValueError(f"{runner} statistics run on {' or '.join(self.backend.devices)}, not {device}")
        self.runner, self.device = runner, torch.device(device)
        self.model = model
        self._axes = model_batch_axes(model.proto)
        self.stages = [list(stage) for stage in stages]
        self.batches = batches
        self.compare_dense = compare_dense
        self.shift_targets = compare_dense and shift_targets
        self.cache_limit = cache_limit
        self.run_limit = run_limit
        self.observers = dict(observers or {})
        self.summary = CalibrationSummary()
        # Bytes the statistics and fit of one stage may take (None: no bound, every layer full), and the M of the
        # pattern (block widths are multiples of it); every layer's plan is kept for the report.
        self.memory_budget, self.group_size = memory_budget, group_size
        self.plans: dict[str, StatisticsPlan] = {}
        self._bytes_per_sample: int | None = None  # the first segment's outputs per sample, once measured
        self.ranks = ranks
        if reconstruction is not None and ranks is not None:
            raise ValueError("reconstruction trains in one process")
        if reconstruction is not None and reconstruction.target == "model" and not compare_dense:
            raise ValueError("reconstruction toward the dense model needs the dense stream beside the converted one")
        self.reconstruction = reconstruction
        if reconstruction is not None:
            self.summary.regions = []
        self._pinned: dict[str, int] = {}  # region inputs kept past their last reader, until their region's end

    def __iter__(self) -> Iterator[tuple[list[PrunableWeight], dict[str, InputStatistics], dict[str, str]]]:
        model = self.model
        taps: list[dict[str, Tap]] = []
        skipped: list[dict[str, str]] = []
        main = model.index.main
        activations = {name for name in main.inputs if name not in main.initializers} | set(main.producers)
        for stage in self.stages:
            found, reasons = {}, {}
            for weight, node in weight_consumers(model, stage).items():
                tap = find_tap(weight, node)
                if not isinstance(tap, str) and tap.activation not in activations:
                    tap = f"its other operand '{tap.activation}' is stored, not computed from the inputs"
                if isinstance(tap, str):
                    reasons[weight.name] = tap
                else:
                    found[weight.name] = tap
            taps.append(found)
            skipped.append(reasons)
        tapped = {w.name: w for stage, found in zip(self.stages, taps, strict=True) for w in stage if w.name in found}
        # Only weights that change between segments are fed; with one stage nothing changes while it runs.
        fed = set(tapped) if len(self.stages) > 1 else set()
        stage_taps = [[tap.activation for tap in found.values()] for found in taps]
        stage_taps[0] += list(self.observers)
        plan = SegmentPlan(model.index, stage_taps, fed)
        self.summary.segments = sum(1 for segment in plan.segments if segment.nodes)
        regions = {}
        if self.reconstruction is not None and len(self.stages) > 1:
            regions = {region.last: region for region in reconstruction_regions(plan, self.reconstruction.span)}
        for region in regions.values():
            for name in region.inputs:
                self._pinned[name] = max(self._pinned.get(name, -2), region.last + 1)
        feeding_segment = {}  # fed weight -> the one segment that reads it (the last, where several do)
        for segment in plan.segments:
            for name in segment.weights:
                feeding_segment[name] = segment.index
        # The stage after which a fed weight's dense values go: after its segment, or its region's reconstruction.
        dense_until = dict(feeding_segment)
        for region in regions.values():
            for name in region.weights:
                dense_until[name] = max(dense_until.get(name, -1), region.last)
        keep_dense = self.compare_dense or bool(regions)
        with SpillStore(self.cache_limit) as store:
            batches: list[int] = []  # batch indices; filled while the first segment reads the data
            clock = time.perf_counter()
            try:
                for k, stage in enumerate(self.stages):
                    stats = self._statistics(stage, taps[k], plan.tainted, skipped[k])
                    self._run_segment(plan, k, taps[k], stats, store, batches, tapped)
                    if self.ranks is not None:
                        self.ranks.sum_statistics(stats.values())
                        if k == 0:
                            self.summary.samples = self.ranks.sum_count(self.summary.samples)
                    if keep_dense:
                        # Dense values of the weights about to change, for the dense runs of the segments reading them
                        # and the reconstruction of their region.
                        for weight in stage:
                            if weight.name in feeding_segment:
                                store.put(("weight", weight.name), np.array(model.read(weight.tensor)))
                    self.summary.seconds += time.perf_counter() - clock
                    yield stage, stats, skipped[k]
                    clock = time.perf_counter()
                    if k in regions:
                        self._reconstruct(plan, regions[k], store, batches, tapped)
                    for name, index in dense_until.items():
                        if index <= k:
                            store.drop(("weight", name))
                    return_freed_memory()
            finally:
                self.summary.cached_peak_bytes = store.peak_in_memory
                self.summary.spilled_bytes = store.spilled_bytes

    def _pieces(self, batches: Iterable[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
        """The batches, each cut along its batch axes into pieces of at most ``run_limit`` bytes of first-segment
        outputs where the model's inputs allow it; the first piece of the first batch is one sample, to measure."""
        inputs, axes = graph_inputs(self.model.proto), self._axes
        for number, item in enumerate(batches):
            self.summary.batches += 1
            shapes = {name: array.shape for name, array in item.items()}
            cuttable = axes.cuttable(inputs, shapes)
            if self.ranks is not None:
                # Each rank its share of the batch's rows; a batch that cannot be cut goes whole to one rank in turn.
                if cuttable and _samples(item, axes) >= self.ranks.world:
                    item = axes.take(item, self.ranks.share(_samples(item, axes)))
                elif number % self.ranks.world != self.ranks.rank:
                    continue
            if not cuttable or (total := _samples(item, axes)) < 2:
                yield item
                continue
            start = 0
            while start < total:
                per_sample = self._bytes_per_sample
                size = 1 if per_sample is None else max(1, self.run_limit // max(1, per_sample))
                yield item if start == 0 and size >= total else axes.take(item, slice(start, start + size))
                start += size

    def _statistics(
        self, stage: list[PrunableWeight], found: dict[str, Tap], tainted: set[str], skipped: dict[str, str]
    ) -> dict[str, InputStatistics]:
        """The stage's empty moments (float32 for wide layers, :func:`~nmdeploy.masks.memory.statistics_itemsize`),
        each weight's full or in diagonal blocks as the memory plan says
        (a weight it cannot afford goes to ``skipped`` with the reason); weights reading one tap the same way share
        one buffer."""
        shapes = [
            LayerShape(
                weight.name,
                reduction_length(weight),
                _output_width(weight),
                shifted=self.shift_targets and found[weight.name].activation in tainted,
            )
            for weight in stage
            if weight.name in found
        ]
        if self.memory_budget is None:
            plans = {shape.name: StatisticsPlan(shape.name, "full", 0) for shape in shapes}
        else:
            plans = {plan.name: plan for plan in plan_statistics(shapes, self.memory_budget, self.group_size)}
        self.plans.update(plans)
        stats, buffers = {}, {}
        for weight in stage:
            plan = plans.get(weight.name)
            if plan is None:
                continue
            if plan.kind == "skip":
                skipped[weight.name] = plan.reason
                del found[weight.name]  # not tapped: it stays dense
                continue
            k = reduction_length(weight)
            key = (found[weight.name], plan.block)
            if key not in buffers:
                buffers[key] = (
                    BlockDiagonal(k, plan.block, device=self.device)
                    if plan.kind == "block-diagonal"
                    else torch.zeros(k, k, dtype=_STATISTICS_DTYPES[statistics_itemsize(k)], device=self.device)
                )
            stats[weight.name] = InputStatistics(weight, found[weight.name].activation, buffers[key])
        return stats

    def _run_segment(
        self,
        plan: SegmentPlan,
        k: int,
        found: dict[str, Tap],
        stats: dict[str, InputStatistics],
        store: SpillStore,
        batches: list[int],
        tapped: dict[str, PrunableWeight],
    ) -> None:
        segment = plan.segments[k]
        model = self.model
        tainted = plan.tainted
        streams = [_CONVERTED]
        outputs_tainted = any(name in tainted for name in segment.outputs)
        taps_tainted = any(tap.activation in tainted for tap in found.values())
        if self.compare_dense and (outputs_tainted or taps_tainted):
            streams.append(_DENSE)
        shared: dict[Tap, list[InputStatistics]] = {}
        for name, tap in found.items():
            shared.setdefault(tap, []).append(stats[name])
        projections: dict[Tap, torch.Tensor] = {}  # tap -> the group's dense [out, K] matrices, stacked
        for tap, group in shared.items():
            if self.shift_targets and _DENSE in streams and tap.activation in tainted:
                narrow = 2 * sum(_output_width(stat.weight) for stat in group) < group[0].hessian.shape[0]
                # Block-diagonal statistics take the [K, out] cross moments, which stay exact.
                if narrow or any(isinstance(stat.hessian, BlockDiagonal) for stat in group):
                    matrices = [_dense_matrix(model, stat.weight) for stat in group]
                    projections[tap] = torch.cat(matrices).to(self.device)
                    for stat in group:
                        width, dtype = _output_width(stat.weight), stat.hessian.dtype
                        stat.cross_outputs = torch.zeros(stat.hessian.shape[0], width, dtype=dtype, device=self.device)
                else:
                    cross = torch.zeros_like(group[0].hessian)
                    for stat in group:
                        stat.cross = cross
        weights = {
            _CONVERTED: {name: model.read(tapped[name].tensor) for name in segment.weights},
            # A weight not converted yet (read here by something other than its GEMM) is still dense in the model.
            _DENSE: {
                name: store.get(("weight", name)) if ("weight", name) in store else model.read(tapped[name].tensor)
                for name in segment.weights
            }
            if _DENSE in streams
            else {},
        }
        session = None
        if segment.nodes:
            # Built before the batches: the weights fed with every run move to the backend's device once per stage.
            protos = {name: tapped[name].tensor for name in segment.weights}
            session = SegmentSession(
                model,
                plan,
                segment,
                protos,
                backend=self.backend,
                device=str(self.device),
                threads=torch.get_num_threads(),
            )
            weights = {stream: session.to_device(values) for stream, values in weights.items()}

        def key(batch: int, name: str, stream: str) -> tuple:
            return (batch, name, stream if name in tainted else _SHARED)

        source = self._pieces(self.batches) if k == 0 else iter(batches)
        for item in source:
            if k == 0:
                batch = len(batches)
                batches.append(batch)
                self.summary.pieces += 1
                self.summary.samples += _samples(item, self._axes)
                if self.backend.keeps_values_on_device:
                    item = _to_device(item, self.device)
                for name, value in item.items():
                    if plan.last_need.get(name, -2) >= 0:
                        store.put(key(batch, name, _CONVERTED), value)
            else:
                batch = item
            values: dict[str, dict[str, np.ndarray]] = {}
            for stream in streams:
                if session is not None:
                    feeds = {name: store.get(key(batch, name, stream)) for name in segment.inputs}
                    values[stream] = session.run({**feeds, **weights[stream]})
                    self.summary.segment_runs += 1
                else:
                    values[stream] = {}
            if k == 0:
                made = sum(value.nbytes for value in values[_CONVERTED].values())
                per_sample = -(-made // _samples(item, self._axes))  # rounded up
                self._bytes_per_sample = max(self._bytes_per_sample or 0, per_sample)
            for tap, group in shared.items():
                name = tap.activation
                converted = values[_CONVERTED].get(name)
                if converted is None:
                    converted = store.get(key(batch, name, _CONVERTED))
                dense = None
                if group[0].shifted:
                    dense = values[_DENSE].get(name)
                    if dense is None:
                        dense = store.get(key(batch, name, _DENSE))
                accumulate(group, tap, converted, dense, projections.get(tap))
            if k == 0:
                for name, observe in self.observers.items():
                    value = values[_CONVERTED].get(name)
                    observe(store.get(key(batch, name, _CONVERTED)) if value is None else value)
            for stream, made in values.items():
                for name, value in made.items():
                    if plan.last_need.get(name, -2) > k and (stream == _CONVERTED or name in tainted):
                        store.put(key(batch, name, stream), value)
            observed = list(self.observers) if k == 0 else []
            for name in list(segment.inputs) + [tap.activation for tap in shared] + observed:
                if max(plan.last_need.get(name, -2), self._pinned.get(name, -2)) <= k:
                    store.drop((batch, name, _SHARED))
                    store.drop((batch, name, _CONVERTED))
                    store.drop((batch, name, _DENSE))

    def _reconstruct(
        self,
        plan: SegmentPlan,
        region: Region,
        store: SpillStore,
        batches: list[int],
        tapped: dict[str, PrunableWeight],
    ) -> None:
        """Train the weights the region reads toward the dense stream's values leaving it, or the region's own dense
        run; then release the region inputs kept for it."""

        def read(batch: int, name: str, dense: bool) -> object:
            stream = (_DENSE if dense else _CONVERTED) if name in plan.tainted else _SHARED
            return store.get((batch, name, stream))

        def write(batch: int, name: str, value: torch.Tensor) -> None:
            # Values stay where the backend keeps them: on its device, or as numpy arrays on the host.
            keep = self.backend.keeps_values_on_device
            store.put((batch, name, _CONVERTED), value if keep else value.cpu().numpy())

        protos = {name: tapped[name].tensor for name in region.weights}
        toward_region = self.reconstruction.target == "region"
        dense = {name: store.get(("weight", name)) for name in region.weights} if toward_region else None
        try:
            result = reconstruct_region(
                self.model, region, protos, batches, read, write, self.reconstruction, self.device, dense
            )
        except (RuntimeError, IndexError, ValueError) as error:  # the runner's InputError quotes its cause
            reason = first_line(error.__cause__ or error)[:200]
            raise InputError(
                f"--reconstruct: the torch interpreter failed on the region of stages {region.first}-{region.last} "
                f"({reason}); convert without --reconstruct"
            ) from error
        self.summary.regions.append(result)
        for name in region.inputs:
            if plan.last_need.get(name, -2) <= region.last and self._pinned.get(name) == region.last + 1:
                for batch in batches:
                    for stream in (_SHARED, _CONVERTED, _DENSE):
                        store.drop((batch, name, stream))
