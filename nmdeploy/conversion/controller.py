"""One calibrated conversion as the user asks for it, the one controller every route uses (``convert``, the
pipeline, a recipe's ``convert`` step): per layer, dense or 2:4, in floating point or 8-bit, with or without
recovery.

The controller chooses one strategy from the options (:data:`STRATEGIES`, first match): ``precision`` (with
``min_fidelity``) is the precision budget (:mod:`nmdeploy.conversion.precision_budget`: {dense, 2:4} x {fp16,
``precision``} per layer, the chosen 2:4 layers recovered before quantization when asked); ``min_fidelity`` alone
the fidelity budget (:mod:`nmdeploy.conversion.budget`: dense or 2:4 per layer, recovering the chosen set when
asked); otherwise every selected layer is fitted, then recovered when asked (:func:`fit_and_recover`). Both budgets
build each set they try with :func:`fit_and_recover`. The fit is the leaf pass
:class:`~nmdeploy.passes.convert.ConvertPass`; this module decides what it fits on and what runs after it.

With ``recover``, the calibration data is split once (recovery's split settings), recovery
records the dense targets on that split before any weight changes, the fit reads its training rows (with augmented
copies for models fed token ids), and recovery fine-tunes what the fit converted. With ``min_fidelity``, the budget
(:mod:`nmdeploy.conversion.budget`) makes the split, chooses the layers and runs this same fit-and-recover on them;
with ``precision`` too, the precision budget does the same and quantizes the recovered mix. Without either, nothing
is held out: the fit reads every calibration row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from nmdeploy.calibration.batch_probe import rows_that_run
from nmdeploy.calibration.data import CalibrationData, CalibrationSplit, Source
from nmdeploy.conversion.budget import convert_within_budget
from nmdeploy.conversion.precision_budget import check_quantize_options, choose_within_precision_budget
from nmdeploy.conversion.recovery import RecoveryOptions
from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, check_min_fidelity
from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks.rounding import check_precision
from nmdeploy.passes.base import Pass, PassResult, ReportRow
from nmdeploy.passes.conversion_report import ConvertedWeight, conversion_outcome, peak_rss_mb
from nmdeploy.passes.convert import ConvertOptions, ConvertPass
from nmdeploy.passes.quantize import QuantizePass


@dataclass
class ConversionOptions(ConvertOptions):
    """The fit's options (:class:`~nmdeploy.passes.convert.ConvertOptions`) and what runs around it; checked when made.

    ``recover``: fine-tuning after the fit (an int is a number of steps, a mapping the
    :class:`~nmdeploy.conversion.recovery.RecoveryOptions` fields: a recipe's ``recover = { steps = 200, seed = 3 }``;
    either judged by ``metric`` unless it names its own). ``min_fidelity``: convert only the layers
    that keep the held-out ``metric`` at or above it (:mod:`nmdeploy.conversion.budget`), judging ``outputs``;
    ``precision`` (int8 or fp8, with ``min_fidelity``): choose per layer among 2:4 and dense, each in fp16 or
    ``precision``, and write one Q/DQ model, quantized with the :class:`~nmdeploy.passes.quantize.QuantizePass`
    keywords ``quantize`` (range method, smoothing, ...), its 2:4 layers recovered before quantization with
    ``recover``;
    ``held_out``: the rows that budget and recovery judge on (None: a seeded share of the calibration rows; with a
    shared :class:`CalibrationData`, always its own held-out rows, read from it). ``device`` is where recovery runs
    too.
    """

    recover: RecoveryOptions | Mapping[str, Any] | int | None = None
    min_fidelity: float | None = None
    metric: FidelityMetric = "auto"
    outputs: tuple[str, ...] | None = None
    held_out: Source | None = None  # rows the budget and recovery judge on, instead of a share of ``calibration``
    precision: str | None = None  # int8 or fp8: the precision budget (with min_fidelity)
    quantize: Mapping[str, Any] | None = None  # QuantizePass keywords for the precision budget's 8-bit layers

    def __post_init__(self) -> None:
        self._check_fit()
        self.recover = _recovery_options(self.recover, self.metric)
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
        self._check_precision()
        self._check_runner()

    def _check_precision(self) -> None:
        if self.precision is None:
            if self.quantize:
                raise InputError(
                    "quantization options are read by the precision budget only: add precision (int8 or fp8)"
                )
            return
        check_precision(self.precision)
        if self.min_fidelity is None:
            raise InputError(
                f"precision {self.precision} chooses per layer under a fidelity floor: add min_fidelity "
                "(--min-fidelity)"
            )
        self.quantize = check_quantize_options(self.calibration, self.precision, self.quantize)

    def fit_options(self, **changes: Any) -> ConvertOptions:
        """The options of the fit alone, with ``changes``."""
        shared = {item.name: getattr(self, item.name) for item in fields(ConvertOptions)}
        return ConvertOptions(**{**shared, **changes})


def _recovery_options(recover: Any, metric: FidelityMetric) -> RecoveryOptions | None:
    """``recover`` as RecoveryOptions: a number of steps, or a mapping of their fields (a recipe's table)."""
    if recover is None or recover is False or isinstance(recover, RecoveryOptions):
        return recover or None
    if recover is True:
        return RecoveryOptions(metric=metric)
    if isinstance(recover, int):
        return RecoveryOptions(steps=recover, metric=metric)
    if not isinstance(recover, Mapping):
        raise InputError(f"recover {recover!r}: give a number of steps or a table of recovery options")
    known = [item.name for item in fields(RecoveryOptions)]
    unknown = sorted(set(recover) - set(known))
    if unknown:
        raise InputError(f"recover: unknown options {unknown}; valid: {', '.join(known)}")
    found = {"metric": metric, **recover}
    if found.get("outputs") is not None:
        found["outputs"] = tuple(found["outputs"])
    try:
        return RecoveryOptions(**found)
    except TypeError as error:  # a value of the wrong type that the options' own checks compare
        raise InputError(f"recover: {error}") from error


class Conversion(Pass):
    """Convert selected weights to N:M with calibration data, with recovery or within a fidelity budget when asked:
    ``Conversion(ConversionOptions(...))``, or the options' fields as keywords (a recipe's form)."""

    name = "convert"
    options_type = ConversionOptions

    def __init__(self, options: ConversionOptions | None = None, /, **fields: Any):
        self.options = options if options is not None else ConversionOptions(**fields)
        if options is not None and fields:
            self.options = replace(options, **fields)

    def requires(self, model: OnnxModel) -> None:
        if self.options.precision is not None:
            QuantizePass(calibration=self.options.calibration, precision=self.options.precision).requires(model)

    def call(self, model: OnnxModel) -> PassResult:
        options = self.options
        data = CalibrationData.of(options.calibration, model.proto, options.batch_size, options.held_out)
        data = rows_that_run(model, data)  # probed once here: the budget's many fits share the answer
        strategy = next(run for applies, run in STRATEGIES if applies(options))
        return strategy(model, options, data)

    def ensures(self, result: PassResult) -> None:
        ConvertPass(self.options.fit_options()).ensures(result)


def fit_and_recover(
    model: OnnxModel, options: ConversionOptions, data: CalibrationData, split: CalibrationSplit | None = None
) -> PassResult:
    """Fit ``model`` in place on ``data`` as ``options`` ask, then recover it when they ask for it; the fit's rows,
    recovery's row, and the summary of the whole (its time and peak memory include recovery's). ``split``: the
    data's fit / held-out split when one was made already (the fit then reads its training rows only; recovery
    makes it with its own settings where none was given)."""
    fit = options.fit_options(calibration=data)
    if options.recover is None:
        return ConvertPass(fit, batches=None if split is None else split.train_batches())(model)
    from nmdeploy.conversion.recovery import Recovery

    start = time.perf_counter()
    _, chosen = ConvertPass(fit).select(model)
    # Before any weight changes: it records the dense targets on the data's one fit / held-out split.
    split = split if split is not None else data.split(options.recover.split)
    recovery = Recovery.prepare(model, chosen, split, options.recover, fit.torch_device)
    result = ConvertPass(fit, batches=recovery.fitting_batches())(model)
    *rows, summary = result.report
    converted = [row.weight for row in rows if isinstance(row, ConvertedWeight) and row.method]
    if not converted:  # nothing to fine-tune: the plain conversion's refusal, with its reasons
        conversion_outcome(rows)
        return result
    rows.append(recovery.run(model, converted, options.progress))
    summary = replace(summary, seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb())
    return PassResult(model, result.modified, [*rows, summary])


def _precision_budget(model: OnnxModel, options: ConversionOptions, data: CalibrationData) -> PassResult:
    return choose_within_precision_budget(options, model, data, fit_and_recover)


def _fidelity_budget(model: OnnxModel, options: ConversionOptions, data: CalibrationData) -> PassResult:
    return convert_within_budget(options, model, data, fit_and_recover)


Strategy = Callable[[OnnxModel, ConversionOptions, CalibrationData], PassResult]

# How the controller converts, by what the options ask: the first whose test holds runs.
STRATEGIES: tuple[tuple[Callable[[ConversionOptions], bool], Strategy], ...] = (
    (lambda options: options.precision is not None, _precision_budget),
    (lambda options: options.min_fidelity is not None, _fidelity_budget),
    (lambda options: True, fit_and_recover),
)


def convert_model_file(model: str | Path, output: str | Path, **fields: Any) -> tuple[Path, list[ReportRow]]:
    """Load ``model``, convert it as :class:`ConversionOptions` ``fields`` ask and save it to ``output`` atomically
    (any error leaves nothing written); the path written and the report."""
    loaded = OnnxModel.load(model)
    loaded.check_save_target(output)
    result = Conversion(**fields)(loaded)
    return loaded.save(output), result.report
