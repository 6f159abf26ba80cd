"""Calibrated N:M conversion of MatMul, Gemm, Conv and recurrent input weights: choose the mask on calibration data,
then refit.

Every selected weight's GEMM input second moments H = X^T X come from running the model in ONNX Runtime over the
calibration data. In sequential mode (the default) the weights are fitted stage by stage, each on the inputs of
the model converted so far, so later layers compensate for the error of earlier ones; in parallel mode all are
fitted on the dense model's inputs in one run. Conv weights [K, C, R, S] are handled as the matrix [K, R*S*C]
(channel fastest) that their im2col GEMM multiplies, so the groups of M are input channels at one kernel position.
An LSTM/GRU/RNN's W [directions, gates * hidden, input] is one [directions * gates * hidden, input] matrix on the op's
input X; its R stays dense (``PrunableWeight.kept_dense``: no graph value holds the hidden state it multiplies).
Existing zeros are never filled: an unstructured-sparse weight keeps its zeros wherever the pattern allows.

This pass is the fit alone, a function of the model and the rows it is given; recovery and the fidelity budget,
which decide which rows it fits on and which layers it converts, run it from :mod:`nmdeploy.conversion`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from nmdeploy.calibration.data import CalibrationData, FeedDict, Source
from nmdeploy.calibration.distributed import Ranks, join
from nmdeploy.calibration.statistics import (
    DEFAULT_CACHE_LIMIT,
    RUNNERS,
    InputStatistics,
    StageStatistics,
    collect_statistics,
    fitting_stages,
)
from nmdeploy.calibration.statistics.engine import DEFAULT_RUN_LIMIT
from nmdeploy.calibration.statistics.reconstruction import DEFAULT_LR as RECONSTRUCTION_LR
from nmdeploy.calibration.statistics.reconstruction import ReconstructionOptions
from nmdeploy.calibration.statistics.taps import as_matrix, from_matrix
from nmdeploy.errors import InputError
from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_NAMES as _FLOAT_DTYPES
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import RECURRENT_GATES, PrunableWeight
from nmdeploy.graph.tensors import to_numpy, to_torch
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks import (
    Pattern,
    is_nm,
    is_transposable,
    nm_mask,
    shifted_target,
    transposable_mask,
)
from nmdeploy.masks.blockwise import BlockDiagonal, reconstruction_error_blockwise, shifted_target_blockwise
from nmdeploy.masks.fitting import DEFAULT_METHOD, LayerFit, fitting_method
from nmdeploy.masks.memory import default_budget
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.passes.base import Pass, PassResult, PostconditionError, ReportRow
from nmdeploy.passes.conversion_report import ConvertedWeight, conversion_summary
from nmdeploy.passes.fit_target import FIT_TARGETS, fit_damping, fit_target
from nmdeploy.passes.permute import PermutedWeight, permute_channels
from nmdeploy.passes.prune import select_weights
from nmdeploy.progress import progress_bar
from nmdeploy.runtimes.devices import resolve_device

# What a conversion holds besides its statistics and activation cache: the interpreter, torch and ONNX Runtime with
# a segment's session (measured: 0.4-0.6 GB on the reference models), plus one run's activations and the model twice.
BASELINE_BYTES = 1 << 29
MIN_STATISTICS_BYTES = 1 << 28  # what a default budget leaves at least for statistics and fits, where it can
# Statistics up to this size are fitted on a private copy; small ones (float64, masks.memory.FLOAT64_LIMIT) in
# float64 (measured on MiniLM: float32 fits moved the sequential result 5e-4 in output cosine between two statistics
# runners that agree to 1e-6), the others in float32 with a float64 retry where float32 fails. Larger statistics
# (float32) are fitted in place, so no layer needs a second large K x K buffer.
COPY_LIMIT = 1 << 26
log = logging.getLogger(__name__)


@dataclass
class ConvertOptions:
    """What the fit is asked to do; checked when made.

    ``calibration``: an .npz, a folder of them, "random", an iterable of feed dicts, or a :class:`CalibrationData`
    (every row read, unless the pass is given its batches). ``method``: a registered fitting method
    (:mod:`nmdeploy.masks.fitting`). ``device``: where the fit runs ("cpu", "cuda", "cuda:N", "auto");
    ``statistics``: what runs the model for them,
    "onnxruntime" (on the CPU), "torch" (the torch interpreter on ``device``) or "auto" (torch on a GPU, ONNX
    Runtime on the CPU, where it is faster).
    """

    calibration: Source | CalibrationData
    pattern: PatternLike = "2:4"
    method: str = DEFAULT_METHOD
    sequential: bool = True
    # What the sequential fit matches (FIT_TARGETS): "auto" is "layer" for language models, "model" otherwise
    fit_target: str = "auto"
    transposable: bool = False
    # The fit's ridge relative to mean diag(X^T X); None: 0.03 for language models, 0.1 otherwise (passes.fit_target)
    damping: float | None = None
    include: str | None = None
    exclude: str | None = None
    eligible_only: bool = False
    permute: bool = False
    permute_iterations: int = 50
    progress: bool | None = False
    batch_size: int | None = None
    cache_limit: int = DEFAULT_CACHE_LIMIT
    device: str = "cpu"
    statistics: str = "auto"
    max_memory_mb: float | None = None  # the memory budget of the statistics and the fit (None: the default)
    sparse_lm_head: bool = False  # convert the lm_head too, tied to the token embedding or not (dense by default)
    # Statistics summed over the processes torchrun started, rank 0 fitting (nmdeploy.calibration.distributed)
    distributed: bool = False
    # Adam steps per region of the sequential fit on its dense outputs (0: none; calibration.statistics.reconstruction)
    reconstruct_steps: int = 0
    reconstruct_lr: float = RECONSTRUCTION_LR
    reconstruct_span: int = 1  # clean-cut regions trained together (2 on a transformer: a whole block)
    reconstruct_precision: str = "float32"  # of the training steps' products ("auto": bfloat16 where native)

    def reconstruction_options(self, target: str) -> ReconstructionOptions:
        """The ``--reconstruct`` settings toward ``target`` (one of reconstruction.TARGETS); they check themselves."""
        return ReconstructionOptions(
            self.reconstruct_steps,
            self.reconstruct_lr,
            target=target,
            span=self.reconstruct_span,
            precision=self.reconstruct_precision,
        )

    def __post_init__(self) -> None:
        self._check_fit()
        self._check_runner()

    def _check_fit(self) -> None:
        method = fitting_method(self.method)  # an unknown name is an InputError listing the registry
        if self.fit_target not in ("auto", *FIT_TARGETS):
            raise InputError(f"--fit-target {self.fit_target!r}: choose auto, {', '.join(FIT_TARGETS)}")
        if self.damping is not None and not (math.isfinite(self.damping) and self.damping > 0):
            raise InputError(
                f"--damping must be a positive number, not {self.damping}; the default is 0.03 for language models, "
                "0.1 otherwise"
            )
        if self.fit_target != "auto" and not self.sequential:
            raise InputError("--fit-target chooses what the sequential fit matches: drop it or --fit parallel")
        if self.reconstruct_steps:
            self.reconstruction_options("model")  # checks them
            # auto resolves here as where training will run: float16 needs CUDA.
            if self.reconstruct_precision == "float16" and not resolve_device(str(self.device)).startswith("cuda"):
                # Said before calibration runs, not when the first region trains.
                raise InputError("--reconstruct-precision float16 is for CUDA devices; on the CPU use bfloat16")
            if not self.sequential:
                raise InputError("--reconstruct trains regions of the sequential fit: drop --fit parallel")
            if self.distributed:
                raise InputError("--reconstruct trains in one process: drop --distributed")
            if not method.needs_statistics:
                raise InputError(f"--reconstruct needs calibration statistics; method {self.method} reads none")
        elif self.reconstruct_steps < 0:
            raise InputError(f"--reconstruct takes a number of steps, not {self.reconstruct_steps}")
        self.pattern = Pattern.parse(self.pattern)
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"calibration batch size must be at least 1, got {self.batch_size}")
        if self.cache_limit < 0:
            raise InputError(f"the activation cache limit must not be negative, got {self.cache_limit}")
        if self.permute and self.transposable:
            raise InputError("--permute reorders the producers' output rows, which breaks their transposable tiles")
        if self.permute and self.distributed:
            raise InputError("--permute runs on one process's statistics; drop it or --distributed")

    def _check_runner(self) -> None:
        if self.statistics not in ("auto", *RUNNERS):
            raise InputError(f"statistics {self.statistics!r}: choose auto, {', '.join(RUNNERS)}")
        resolve_device(self.device)  # a device this machine lacks is refused before any work
        if self.max_memory_mb is not None and not (math.isfinite(self.max_memory_mb) and self.max_memory_mb > 0):
            raise InputError(f"--max-memory must be a positive number of MB, not {self.max_memory_mb}")

    @property
    def torch_device(self) -> str:
        """The device the fit (and recovery) run on (``auto`` resolved)."""
        return resolve_device(self.device)

    @property
    def statistics_runner(self) -> str:
        """What runs the model for the statistics: ``auto`` is the torch interpreter on a GPU, ONNX Runtime on the
        CPU (measured faster there)."""
        if self.statistics != "auto":
            return self.statistics
        return "onnxruntime" if self.torch_device == "cpu" else "torch"


class ConvertPass(Pass):
    """Convert selected weights to N:M with calibration data: ``ConvertPass(ConvertOptions(...))``, or the options'
    fields as keywords. ``batches``: the feed dicts the fit reads, in place of every calibration row (a split's
    training rows, with augmented copies when recovery asks for them); the pass keeps them as given to it."""

    name = "convert"
    options_type = ConvertOptions

    def __init__(
        self, options: ConvertOptions | None = None, /, *, batches: Sequence[FeedDict] | None = None, **fields: Any
    ):
        if options is not None and type(options) is not ConvertOptions:
            # A subclass's extra fields (recovery, a fidelity floor) would be dropped without a word here.
            raise TypeError(f"ConvertPass takes ConvertOptions, not {type(options).__name__}: run those through theirs")
        self.options = options if options is not None else ConvertOptions(**fields)
        if options is not None and fields:
            self.options = replace(options, **fields)
        self.batches = None if batches is None else list(batches)
        self.method = fitting_method(self.options.method)
        self.device = self.options.torch_device
        self.runner = self.options.statistics_runner

    @property
    def pattern(self) -> Pattern:
        return self.options.pattern

    def select(self, model: OnnxModel) -> tuple[list[ConvertedWeight], list[PrunableWeight]]:
        """The rows of the weights this pass skips (and why), and the weights it converts (finite, checked)."""
        options = self.options
        candidates = select_weights(find_prunable_weights(model.proto).weights, options.include, options.exclude)
        rows: list[ConvertedWeight] = []
        chosen = []
        for weight in candidates:
            reason = self.skip_reason(weight)
            if reason:
                rows.append(ConvertedWeight(weight.name, node=weight.node_label, skipped=reason))
            else:
                chosen.append(weight)
        if not chosen:
            raise InputError("nothing to convert: no MatMul, Gemm, Conv or recurrent float weight matched")
        model.check_finite(weight.tensor for weight in chosen)
        return rows, chosen

    def call(self, model: OnnxModel) -> PassResult:
        options = self.options
        data = CalibrationData.of(options.calibration, model.proto, options.batch_size)
        start = time.perf_counter()
        damping = fit_damping(model, options.damping)
        skipped_rows, chosen = self.select(model)
        rows: list[ReportRow] = list(skipped_rows)
        if options.permute:
            rows += self._permute(model, chosen, data)
        converted: list[PrunableWeight] = []
        summary = None
        max_memory = None
        target = None
        ranks = join() if options.distributed and self.method.needs_statistics else None
        with progress_bar(len(chosen), desc="convert", unit="layer", enabled=options.progress is not False) as bar:
            if not self.method.needs_statistics:
                for weight in chosen:
                    rows.append(self._convert(model, weight, None, damping=damping))
                    converted.append(weight)
                    bar.update()
            else:
                stages = fitting_stages(model, chosen) if options.sequential else [chosen]
                labels = {weight.name: weight.node_label for weight in chosen}
                target = fit_target(model, options.fit_target) if len(stages) > 1 else None
                reconstruction = self._reconstruction(len(stages), target)
                # Matching the dense model's outputs (the fit, and reconstruction toward them) needs the dense model
                # run beside the converted one wherever their values differ; the layer target needs neither.
                max_memory, cache_limit, statistics_budget = self._memory(model, ranks)
                run = StageStatistics(
                    model,
                    stages,
                    self._batches(data),
                    compare_dense=target == "model",
                    shift_targets=target == "model",
                    cache_limit=cache_limit,
                    memory_budget=statistics_budget,
                    group_size=self.pattern.m,
                    ranks=ranks,
                    reconstruction=reconstruction,
                    **self._statistics_runner(),
                )
                for stage, stats, skipped in run:
                    if ranks is not None and not ranks.leader:
                        # Rank 0 fits; this rank takes its weights before the next stage runs on them.
                        ranks.share_weights(model, [weight.tensor for weight in stage if weight.name in stats])
                        bar.update(len(stage))
                        continue
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
                            rows.append(self._convert(model, weight, stats[weight.name], shared, damping))
                            converted.append(weight)
                        bar.update()
                    if ranks is not None:
                        ranks.share_weights(model, [weight.tensor for weight in stage if weight.name in stats])
                summary = run.summary
        count = len(converted)
        if ranks is not None:
            rows, count = ranks.from_leader((rows, count))  # the fit's report, as rank 0 made it
        row = conversion_summary(start, summary, rows, count, max_memory, data.row_by_row)
        row.fit_target = target if self.method.needs_statistics else None
        row.damping = damping if self.method.needs_statistics else None
        rows.append(row)
        return PassResult(model, bool(count), rows)

    def _reconstruction(self, stages: int, target: str | None) -> ReconstructionOptions | None:
        """Region reconstruction where asked and the fit has stages to run between (one stage has no region), toward
        what the layers were fitted to: the dense model's values, or (layer target) each region's own dense run."""
        options = self.options
        if not options.reconstruct_steps or stages < 2:
            return None
        toward = "model" if target == "model" else "region"
        return options.reconstruction_options(toward)

    def _memory(self, model: OnnxModel, ranks: Ranks | None = None) -> tuple[int, int, int]:
        """The memory budget (``max_memory_mb``; default: half the memory available now, raised to what the
        conversion needs where that is within 80 % of it, :func:`~nmdeploy.masks.memory.default_budget`), the
        activation cache limit within it (at most a quarter) and the bytes left for one stage's statistics and fits.
        Across ranks, rank 0's default (its share of the memory available to all): every rank plans the same
        statistics."""
        options = self.options
        model_bytes = 2 * model.proto.ByteSize()
        # What the default reaches for where half the memory is less: the fixed cost with the smallest useful cache
        # (a quarter of the budget) and room for the statistics of a few layers.
        needed = (BASELINE_BYTES + DEFAULT_RUN_LIMIT + model_bytes + MIN_STATISTICS_BYTES) * 4 // 3
        total = default_budget(needed=needed) if options.max_memory_mb is None else int(options.max_memory_mb * 2**20)
        if ranks is not None and options.max_memory_mb is None:
            total = ranks.from_leader(total // ranks.world)
        cache = min(options.cache_limit, total // 4)
        fixed = BASELINE_BYTES + DEFAULT_RUN_LIMIT + cache + model_bytes
        if total <= fixed:
            raise InputError(
                f"--max-memory {total / 2**20:.0f} MB: the conversion holds about {fixed / 2**20:.0f} MB besides its "
                "statistics (the interpreter and its sessions, one run's activations, the activation cache, the "
                f"model); give more, or a smaller --cache-limit"
            )
        return total, cache, total - fixed

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
        """The batches the fit sees: those it was given (a split's training rows), else every calibration row."""
        if self.batches is not None:
            return self.batches
        return data.batches()

    def _convert(
        self,
        model: OnnxModel,
        weight: PrunableWeight,
        stats: InputStatistics | None,
        shared: bool = False,
        damping: float | None = None,
    ) -> ConvertedWeight:
        options, method = self.options, self.method
        damping = damping if damping is not None else fit_damping(model, options.damping)
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
                target = shifted_target(dense, hessian, cross, 10 * damping, overwrite=in_place)
            else:
                cross_outputs = stats.cross_outputs.to(self.device)
                target = shifted_target_blockwise(
                    dense, hessian, cross_outputs.to(dense.dtype), 10 * damping, overwrite=in_place
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
        layer = LayerFit(matrix, support, hessian, self.pattern, damping, overwrite=overwrite)
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
        if weight.dense_by_default and not self.options.sparse_lm_head:
            return f"{weight.dense_by_default} (--sparse-lm-head converts it too)"
        if weight.dtype not in _FLOAT_DTYPES:
            return f"{weight.dtype} weight (calibrated conversion handles float weights)"
        if weight.kept_dense:
            return weight.kept_dense
        op = weight.uses[0].op_type
        if weight.axis is None or op not in ("MatMul", "Gemm", "Conv", *RECURRENT_GATES):
            return "not a MatMul, Gemm, Conv or recurrent input weight with one reduction axis"
        if op not in ("Conv", *RECURRENT_GATES) and len(weight.shape) != 2:
            return f"{len(weight.shape)}-D {op} weight (batched weights are pruned, not converted)"
        options = self.options
        if weight.shape[weight.axis] % self.pattern.m:
            return f"axis {weight.axis} has length {weight.shape[weight.axis]}, not a multiple of {self.pattern.m}"
        if options.transposable and (op not in ("MatMul", "Gemm") or weight.shape[1 - weight.axis] % self.pattern.m):
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
            raise PostconditionError(f"convert lost track of {missing[:3]}")
        for weight in weights:
            matrix = as_matrix(weight, to_torch(result.model.read(weight.tensor)))
            if not is_nm(matrix, self.pattern, 1):
                raise PostconditionError(f"convert left '{weight.name}' not {self.pattern}")
            if self.options.transposable and not is_transposable(matrix, self.pattern):
                raise PostconditionError(f"convert left '{weight.name}' not transposable {self.pattern}")


def _nbytes(statistics: torch.Tensor | BlockDiagonal) -> int:
    if isinstance(statistics, BlockDiagonal):
        return statistics.nbytes
    return statistics.numel() * statistics.element_size()
