"""Calibrated N:M conversion of MatMul, Gemm and Conv weights: choose the mask on calibration data, then refit.

Every selected weight's GEMM input second moments H = X^T X come from running the model in ONNX Runtime over the
calibration data. In sequential mode (the default) the weights are fitted stage by stage, each on the inputs of
the model converted so far, so later layers compensate for the error of earlier ones; in parallel mode all are
fitted on the dense model's inputs in one run. Conv weights [K, C, R, S] are handled as the matrix [K, R*S*C]
(channel fastest) that their im2col GEMM multiplies, so the groups of M are input channels at one kernel position.
Existing zeros are never filled: an unstructured-sparse weight keeps its zeros wherever the pattern allows.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmdeploy.conversion.batch_probe import feed_row_by_row
from nmdeploy.conversion.data import CalibrationData, Source
from nmdeploy.conversion.methods import DEFAULT_METHOD, LayerFit, fitting_method
from nmdeploy.conversion.recovery import RecoveryOptions
from nmdeploy.conversion.statistics import (
    DEFAULT_CACHE_LIMIT,
    RUNNERS,
    InputStatistics,
    StageStatistics,
    collect_statistics,
    fitting_stages,
)
from nmdeploy.conversion.statistics.engine import DEFAULT_RUN_LIMIT
from nmdeploy.conversion.statistics.taps import as_matrix, from_matrix
from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, check_min_fidelity
from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_NAMES as _FLOAT_DTYPES
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import to_numpy, to_torch
from nmdeploy.graph.weights import PrunableWeight, find_prunable_weights
from nmdeploy.masks import (
    Pattern,
    is_nm,
    is_transposable,
    nm_mask,
    shifted_target,
    transposable_mask,
)
from nmdeploy.masks.blockwise import BlockDiagonal, reconstruction_error_blockwise, shifted_target_blockwise
from nmdeploy.masks.memory import default_budget
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.passes.base import Pass, PassResult, ReportRow, optional
from nmdeploy.passes.permute import PermutedWeight, permute_channels
from nmdeploy.passes.prune import select_weights
from nmdeploy.progress import progress_bar
from nmdeploy.runtimes.devices import resolve_device

# What a conversion holds besides its statistics and activation cache: the interpreter, torch and ONNX Runtime with
# a segment's session (measured: 0.4-0.6 GB on the reference models), plus one run's activations and the model twice.
BASELINE_BYTES = 1 << 29
# Statistics up to this size are fitted on a private copy; small ones (float64, masks.memory.FLOAT64_LIMIT) in
# float64 (measured on MiniLM: float32 fits moved the sequential result 5e-4 in output cosine between two statistics
# runners that agree to 1e-6), the others in float32 with a float64 retry where float32 fails. Larger statistics
# (float32) are fitted in place, so no layer needs a second large K x K buffer.
COPY_LIMIT = 1 << 26
BLOCK_COST = (
    "cross-block input correlations are dropped; measured on MiniLM's FFN projections (K = 1536): output error "
    "+37-40 % with blocks of K/2, +75-80 % with K/4 (block_diagonal_cost in nmdeploy.masks.blockwise)"
)
log = logging.getLogger(__name__)


@dataclass
class ConvertOptions:
    """Everything a conversion is asked to do; checked when made.

    ``calibration``: an .npz, a folder of them, "random", an iterable of feed dicts, or a :class:`CalibrationData`
    (its split shared). ``method``: a registered fitting method (:mod:`nmdeploy.conversion.methods`). ``recover``:
    fine-tuning after the fit (an int is a number of steps). ``min_fidelity``: convert only the layers that keep the
    held-out ``metric`` at or above it (:mod:`nmdeploy.conversion.budget`), judging ``outputs``; ``held_out``: the
    rows that budget and recovery judge on (None: a seeded share of the calibration rows; with a shared
    :class:`CalibrationData`, always its own held-out rows, read from it). ``device``: where
    the fit and recovery run ("cpu", "cuda", "cuda:N", "auto"); ``statistics``: what runs the model for them,
    "onnxruntime" (on the CPU), "torch" (the torch interpreter on ``device``) or "auto" (torch on a GPU, ONNX
    Runtime on the CPU, where it is faster).
    """

    calibration: Source | CalibrationData
    pattern: PatternLike = "2:4"
    method: str = DEFAULT_METHOD
    sequential: bool = True
    transposable: bool = False
    damping: float = 0.1
    include: str | None = None
    exclude: str | None = None
    eligible_only: bool = False
    permute: bool = False
    permute_iterations: int = 50
    progress: bool | None = False
    batch_size: int | None = None
    cache_limit: int = DEFAULT_CACHE_LIMIT
    recover: RecoveryOptions | int | None = None
    min_fidelity: float | None = None
    metric: FidelityMetric = "auto"
    outputs: tuple[str, ...] | None = None
    device: str = "cpu"
    statistics: str = "auto"
    max_memory_mb: float | None = None  # the memory budget of the statistics and the fit (None: the default)
    held_out: Source | None = None  # rows the budget and recovery judge on, instead of a share of ``calibration``
    sparse_tied_embedding: bool = False  # convert a tied lm_head / token embedding too (dense by default)

    def __post_init__(self) -> None:
        fitting_method(self.method)  # an unknown name is an InputError listing the registry
        self.pattern = Pattern.parse(self.pattern)
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"calibration batch size must be at least 1, got {self.batch_size}")
        if self.cache_limit < 0:
            raise InputError(f"the activation cache limit must not be negative, got {self.cache_limit}")
        if isinstance(self.recover, int) and not isinstance(self.recover, bool):
            self.recover = RecoveryOptions(steps=self.recover, metric=self.metric)
        if self.permute and self.transposable:
            raise InputError("--permute reorders the producers' output rows, which breaks their transposable tiles")
        if self.min_fidelity is not None:
            check_min_fidelity(self.min_fidelity)
        if isinstance(self.calibration, CalibrationData):
            # Shared data is the one source of its held-out rows: held_out is read from it, never compared with it
            # (a one-shot iterator given to the data is kept there as a list, so no identity would hold).
            if self.held_out is not None and self.calibration.held_out_source is None:
                raise InputError(
                    "held-out data goes to the CalibrationData every step shares: CalibrationData(..., held_out=...)"
                )
            self.held_out = self.calibration.held_out_source
        elif self.held_out is not None and self.min_fidelity is None and not self.recover:
            raise InputError("held-out data is read by --min-fidelity and --recover only: add one, or drop --held-out")
        if self.outputs is not None:
            self.outputs = tuple(self.outputs)
        if self.statistics not in ("auto", *RUNNERS):
            raise InputError(f"statistics {self.statistics!r}: choose auto, {', '.join(RUNNERS)}")
        resolve_device(self.device)  # a device this machine lacks is refused before any work
        if self.max_memory_mb is not None and not (math.isfinite(self.max_memory_mb) and self.max_memory_mb > 0):
            raise InputError(f"--max-memory must be a positive number of MB, not {self.max_memory_mb}")

    @property
    def torch_device(self) -> str:
        """The device the fit and recovery run on (``auto`` resolved)."""
        return resolve_device(self.device)

    @property
    def statistics_runner(self) -> str:
        """What runs the model for the statistics: ``auto`` is the torch interpreter on a GPU, ONNX Runtime on the
        CPU (measured faster there)."""
        if self.statistics != "auto":
            return self.statistics
        return "onnxruntime" if self.torch_device == "cpu" else "torch"


@dataclass
class ConvertedWeight(ReportRow):
    """One weight: skipped (and why), or its mask's method, the saliency it kept, the zeros it kept of those it had,
    and, when fitted on calibration data, the output error of the plain mask and of the fitted weight."""

    step: str = field(default="convert", init=False)
    weight: str
    node: str | None = optional()  # the consumer node's name (PrunableWeight.node_label), as tables show it
    skipped: str | None = optional()
    shape: list[int] | None = optional()
    axis: int | None = optional()
    method: str | None = optional()
    retained_saliency: float | None = optional()
    zeros_before: int | None = optional()
    zeros_kept: int | None = optional()
    error_masked: float | None = optional()
    error_converted: float | None = optional()
    samples: int | None = optional()
    # "full" or "block-diagonal, blocks of B of K columns" (errors are then on those blocks), the float32
    # statistics' size, and the fit's precision (float64 for small layers and where float32 failed)
    statistics: str | None = optional()
    statistics_mb: float | None = optional()
    precision: str | None = optional()


@dataclass
class ConversionSummary(ReportRow):
    """The conversion's cost; the calibration fields are set when a fit read calibration data."""

    step: str = field(default="summary", init=False)
    seconds: float
    converted: int
    peak_rss_mb: float
    calibration_seconds: float | None = optional()
    calibration_batches: int | None = optional()
    calibration_samples: int | None = optional()
    segments: int | None = optional()
    cached_peak_mb: float | None = optional()
    spilled: bool | None = optional()
    spilled_mb: float | None = optional()
    max_memory_mb: float | None = optional()  # the memory budget the statistics were planned in
    approximations: list[str] | None = optional()  # every approximation the budget forced, with its measured cost
    row_by_row: bool | None = optional()  # the model runs only at batch 1: calibrated one row per run


class ConvertPass(Pass):
    """Convert selected weights to N:M with calibration data: ``ConvertPass(ConvertOptions(...))``, or the options'
    fields as keywords (a recipe's form)."""

    name = "convert"
    options_type = ConvertOptions

    def __init__(self, options: ConvertOptions | None = None, /, **fields: Any):
        self.options = options if options is not None else ConvertOptions(**fields)
        if options is not None and fields:
            self.options = replace(options, **fields)
        self.method = fitting_method(self.options.method)
        self.device = self.options.torch_device
        self.runner = self.options.statistics_runner
        self._recovery = None

    @property
    def pattern(self) -> Pattern:
        return self.options.pattern

    def call(self, model: OnnxModel) -> PassResult:
        options = self.options
        data = CalibrationData.of(options.calibration, model.proto, options.batch_size, options.held_out)
        self.row_by_row = feed_row_by_row(model, data)
        if options.min_fidelity is not None:
            from nmdeploy.conversion.budget import convert_within_budget

            return convert_within_budget(self, model, data)
        start = time.perf_counter()
        candidates = select_weights(find_prunable_weights(model.proto).weights, options.include, options.exclude)
        rows: list[ReportRow] = []
        chosen = []
        for weight in candidates:
            reason = self.skip_reason(weight)
            if reason:
                rows.append(ConvertedWeight(weight.name, node=weight.node_label, skipped=reason))
            else:
                chosen.append(weight)
        if not chosen:
            raise InputError("nothing to convert: no MatMul, Gemm or Conv float weight matched")
        model.check_finite(weight.tensor for weight in chosen)
        recovery = None
        if options.recover is not None:
            from nmdeploy.conversion.recovery import Recovery

            # Before any weight changes: it records the dense targets on the data's one fit / held-out split.
            recovery = Recovery.prepare(model, chosen, data, options.recover, self.device)
        self._recovery = recovery
        if options.permute:
            rows += self._permute(model, chosen, data)
        converted: list[PrunableWeight] = []
        summary = None
        with progress_bar(len(chosen), desc="convert", unit="layer", enabled=options.progress is not False) as bar:
            if not self.method.needs_statistics:
                for weight in chosen:
                    rows.append(self._convert(model, weight, None))
                    converted.append(weight)
                    bar.update()
            else:
                stages = fitting_stages(model, chosen) if options.sequential else [chosen]
                labels = {weight.name: weight.node_label for weight in chosen}
                # Sequential fitting matches every layer to the dense model's outputs, so the dense model runs beside
                # the converted one wherever their inputs differ.
                cache_limit, statistics_budget = self._memory(model)
                run = StageStatistics(
                    model,
                    stages,
                    self._batches(data),
                    compare_dense=len(stages) > 1,
                    cache_limit=cache_limit,
                    memory_budget=statistics_budget,
                    group_size=self.pattern.m,
                    **self._statistics_runner(),
                )
                for stage, stats, skipped in run:
                    rows += [
                        ConvertedWeight(name, node=labels.get(name), skipped=reason) for name, reason in skipped.items()
                    ]
                    for position, weight in enumerate(stage):
                        if weight.name in stats:
                            # Statistics shared with a later weight of the stage (same input) must survive this fit.
                            shared = any(
                                stats[other.name].hessian is stats[weight.name].hessian
                                for other in stage[position + 1 :]
                                if other.name in stats
                            )
                            rows.append(self._convert(model, weight, stats[weight.name], shared))
                            converted.append(weight)
                        bar.update()
                summary = run.summary
        if recovery is not None:
            rows.append(recovery.run(model, [weight.name for weight in converted], options.progress))
        rows.append(self._summary(start, summary, rows, len(converted)))
        return PassResult(model, bool(converted), rows)

    def _memory(self, model: OnnxModel) -> tuple[int, int]:
        """The activation cache limit and the bytes left for one stage's statistics and fits within
        ``max_memory_mb`` (default: half the memory available now): the cache gets at most a quarter of it."""
        options = self.options
        total = default_budget() if options.max_memory_mb is None else int(options.max_memory_mb * 2**20)
        self._max_memory = total
        cache = min(options.cache_limit, total // 4)
        fixed = BASELINE_BYTES + DEFAULT_RUN_LIMIT + cache + 2 * model.proto.ByteSize()
        if total <= fixed:
            raise InputError(
                f"--max-memory {total / 2**20:.0f} MB: the conversion holds about {fixed / 2**20:.0f} MB besides its "
                "statistics (the interpreter and its sessions, one run's activations, the activation cache, the "
                f"model); give more, or a smaller --cache-limit"
            )
        return cache, total - fixed

    def _summary(self, start: float, summary, rows: list[ReportRow], converted_count: int) -> ConversionSummary:
        """The conversion's cost: wall time, calibration data used, peak memory, whether cached values spilled, the
        memory budget and the approximations it forced."""
        row = ConversionSummary(time.perf_counter() - start, converted_count, _peak_rss_mb())
        row.row_by_row = getattr(self, "row_by_row", False) or None
        if getattr(self, "_max_memory", None) is not None:
            row.max_memory_mb = self._max_memory / 2**20
            converted = [r for r in rows if isinstance(r, ConvertedWeight)]
            blocked = [r for r in converted if r.statistics and r.statistics.startswith("block")]
            skipped = [r for r in converted if r.skipped and "--max-memory" in r.skipped]
            notes = []
            if blocked:
                notes.append(f"block-diagonal statistics for {len(blocked)} layer(s) beyond the budget: {BLOCK_COST}")
            if skipped:
                notes.append(f"{len(skipped)} layer(s) left dense: their statistics do not fit even in blocks")
            row.approximations = notes or None
        if summary is not None:
            row.calibration_seconds = summary.seconds
            row.calibration_batches = summary.batches
            row.calibration_samples = summary.samples
            row.segments = summary.segments
            row.cached_peak_mb = summary.cached_peak_bytes / 2**20
            row.spilled = summary.spilled
            row.spilled_mb = summary.spilled_bytes / 2**20
        return row

    def _permute(self, model: OnnxModel, chosen: list[PrunableWeight], data: CalibrationData) -> list[PermutedWeight]:
        """Reorder input channels (and their producers' outputs) to keep more saliency; the function is unchanged.

        Runs before any weight changes, on dense statistics, so the conversion that follows sees the permuted model.
        """
        stats, _ = collect_statistics(
            model, chosen, self._batches(data), cache_limit=self.options.cache_limit, **self._statistics_runner()
        )
        scales = {}
        for name, stat in stats.items():
            channels = stat.weight.shape[stat.weight.axis]
            energy = stat.hessian.diagonal().clamp_min(0).view(-1, channels).mean(dim=0)  # conv: over kernel positions
            scales[name] = energy.sqrt()
        outcome = permute_channels(
            model, chosen, scales, pattern=self.pattern, max_iterations=self.options.permute_iterations
        )
        return [replace(row, step="permute") for row in outcome.rows]

    def _statistics_runner(self) -> dict[str, str]:
        """The statistics engine's runner and device: ONNX Runtime runs on the CPU whatever the fit's device."""
        return {"runner": self.runner, "device": self.device if self.runner == "torch" else "cpu"}

    def _batches(self, data: CalibrationData) -> Iterable[dict[str, np.ndarray]]:
        """The calibration batches the fit sees: the fit split once the data was split (with recovery, also its
        augmented copies), else every row."""
        if self._recovery is not None:
            return self._recovery.fitting_batches()
        return data.fit_batches()

    def _convert(
        self,
        model: OnnxModel,
        weight: PrunableWeight,
        stats: InputStatistics | None,
        shared: bool = False,
    ) -> ConvertedWeight:
        options, method = self.options, self.method
        values = model.read(weight.tensor)
        stored = to_torch(values)
        dense = as_matrix(weight, stored.to(self.device, torch.float64))
        nonzero = dense != 0
        # Moments made by ONNX Runtime are on the CPU: the fit runs on its own device.
        hessian = stats.hessian.to(self.device) if stats is not None else None
        private = isinstance(hessian, torch.Tensor) and hessian.dtype == torch.float64
        if private:
            hessian = hessian.clone()  # this layer's own, used up by its fit
        # Large statistics are factorised in place (no second K x K buffer); used up where no one reads them after.
        in_place = hessian is not None and (private or _nbytes(hessian) > COPY_LIMIT)
        matrix = dense
        if stats is not None and stats.shifted:
            # W* is an unconstrained regression over all K inputs; a ridge ten times the fit's keeps it from
            # chasing the calibration set (measured on MiniLM: 1.0 beats 0.1 and 10 at a fit damping of 0.1).
            if stats.cross is not None:
                cross = stats.cross.to(self.device)
                target = shifted_target(dense, hessian, cross, 10 * options.damping, overwrite=in_place)
            else:
                cross_outputs = stats.cross_outputs.to(self.device)
                target = shifted_target_blockwise(
                    dense, hessian, cross_outputs.to(dense.dtype), 10 * options.damping, overwrite=in_place
                )
            matrix = target * nonzero
        scores = method.score(matrix, hessian)
        # Existing zeros score 0, so they are pruned first; the fit never moves weight onto them.
        keep = None
        if options.transposable:
            keep = transposable_mask(scores, self.pattern).to(torch.bool)
        elif not method.chooses_mask:
            keep = nm_mask(scores, self.pattern, 1, score=scores)
        support = nonzero if keep is None else keep & nonzero
        overwrite = in_place and (private or not shared)
        layer = LayerFit(matrix, support, hessian, self.pattern, options.damping, overwrite=overwrite)
        converted = method.fit(layer)
        if method.chooses_mask:
            keep = converted != 0
        result = from_matrix(weight, converted).to("cpu", stored.dtype).contiguous()
        model.write(weight.tensor, to_numpy(result, values))
        total = float(scores.sum())
        row = ConvertedWeight(
            weight.name,
            node=weight.node_label,
            shape=list(weight.shape),
            axis=weight.axis,
            method=method.name,
            retained_saliency=float((scores * keep).sum()) / total if total else 1.0,
            zeros_before=int((~nonzero).sum()),
            zeros_kept=int((~nonzero & (converted == 0)).sum()),
        )
        if hessian is not None:
            if layer.error_converted is None:
                layer.error_masked = reconstruction_error_blockwise(matrix, matrix * keep, hessian)
                layer.error_converted = reconstruction_error_blockwise(matrix, converted, hessian)
            row.error_masked, row.error_converted = layer.error_masked, layer.error_converted
            row.samples = stats.samples
            row.statistics = (
                f"block-diagonal, blocks of {hessian.block} of {hessian.k} columns"
                if isinstance(hessian, BlockDiagonal)
                else "full"
            )
            row.statistics_mb = _nbytes(stats.hessian) / 2**20
            row.precision = layer.precision or str(hessian.dtype).removeprefix("torch.")
        return row

    def skip_reason(self, weight: PrunableWeight) -> str | None:
        if weight.dense_by_default and not self.options.sparse_tied_embedding:
            return f"{weight.dense_by_default} (--sparse-tied-embedding converts it too)"
        if weight.dtype not in _FLOAT_DTYPES:
            return f"{weight.dtype} weight (calibrated conversion handles float weights)"
        op = weight.uses[0].op_type
        if weight.axis is None or op not in ("MatMul", "Gemm", "Conv"):
            return "not a MatMul, Gemm or Conv weight with one reduction axis"
        if op != "Conv" and len(weight.shape) != 2:
            return f"{len(weight.shape)}-D {op} weight (batched weights are pruned, not converted)"
        options = self.options
        if weight.shape[weight.axis] % self.pattern.m:
            return f"axis {weight.axis} has length {weight.shape[weight.axis]}, not a multiple of {self.pattern.m}"
        if options.transposable and (op == "Conv" or weight.shape[1 - weight.axis] % self.pattern.m):
            return "transposable masks need a 2-D weight whose both axes are multiples of M"
        if options.eligible_only and not tensorrt_verdict(weight, self.pattern).eligible:
            return "not TensorRT-eligible"
        return None

    def ensures(self, result: PassResult) -> None:
        converted = {row.weight for row in result.report if isinstance(row, ConvertedWeight) and row.method}
        found = find_prunable_weights(result.model.proto, result.model.index).weights
        weights = [weight for weight in found if weight.name in converted]
        if len(weights) != len(converted):
            missing = sorted(converted - {weight.name for weight in weights})
            raise AssertionError(f"convert lost track of {missing[:3]}")
        for weight in weights:
            matrix = as_matrix(weight, to_torch(result.model.read(weight.tensor)))
            if not is_nm(matrix, self.pattern, 1):
                raise AssertionError(f"convert left '{weight.name}' not {self.pattern}")
            if self.options.transposable and not is_transposable(matrix, self.pattern):
                raise AssertionError(f"convert left '{weight.name}' not transposable {self.pattern}")


def _nbytes(statistics: torch.Tensor | BlockDiagonal) -> int:
    if isinstance(statistics, BlockDiagonal):
        return statistics.nbytes
    return statistics.numel() * statistics.element_size()


def _peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB.

    Linux's VmHWM belongs to the running program alone; getrusage's ru_maxrss also keeps the peak of the process
    that forked it (it survives exec), so a conversion started from a large Python process would report that.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not on Windows
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
