"""One calibrated conversion as the user asks for it: the fit, recovery after it, or the fidelity budget around both.

The fit is the leaf pass :class:`~nmdeploy.passes.convert.ConvertPass`; this module decides what it fits on and
what runs after it. With ``recover``, the calibration data is split once (recovery's split settings), recovery
records the dense targets on that split before any weight changes, the fit reads its training rows (with augmented
copies for models fed token ids), and recovery fine-tunes what the fit converted. With ``min_fidelity``, the budget
(:mod:`nmdeploy.conversion.budget`) makes the split, chooses the layers and runs this same fit-and-recover on them.
Without either, nothing is held out: the fit reads every calibration row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any

from nmdeploy.calibration.batch_probe import rows_that_run
from nmdeploy.calibration.data import CalibrationData, CalibrationSplit, Source
from nmdeploy.conversion.budget import convert_within_budget
from nmdeploy.conversion.recovery import RecoveryOptions
from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, check_min_fidelity
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.base import Pass, PassResult
from nmdeploy.passes.convert import ConvertedWeight, ConvertOptions, ConvertPass, peak_rss_mb


@dataclass
class ConversionOptions(ConvertOptions):
    """The fit's options (:class:`~nmdeploy.passes.convert.ConvertOptions`) and what runs around it; checked when made.

    ``recover``: fine-tuning after the fit (an int is a number of steps). ``min_fidelity``: convert only the layers
    that keep the held-out ``metric`` at or above it (:mod:`nmdeploy.conversion.budget`), judging ``outputs``;
    ``held_out``: the rows that budget and recovery judge on (None: a seeded share of the calibration rows; with a
    shared :class:`CalibrationData`, always its own held-out rows, read from it). ``device`` is where recovery runs
    too.
    """

    recover: RecoveryOptions | int | None = None
    min_fidelity: float | None = None
    metric: FidelityMetric = "auto"
    outputs: tuple[str, ...] | None = None
    held_out: Source | None = None  # rows the budget and recovery judge on, instead of a share of ``calibration``

    def __post_init__(self) -> None:
        self._check_fit()
        if isinstance(self.recover, int) and not isinstance(self.recover, bool):
            self.recover = RecoveryOptions(steps=self.recover, metric=self.metric)
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
        self._check_runner()

    def fit_options(self, **changes: Any) -> ConvertOptions:
        """The options of the fit alone, with ``changes``."""
        shared = {item.name: getattr(self, item.name) for item in fields(ConvertOptions)}
        return ConvertOptions(**{**shared, **changes})


class Conversion(Pass):
    """Convert selected weights to N:M with calibration data, with recovery or within a fidelity budget when asked:
    ``Conversion(ConversionOptions(...))``, or the options' fields as keywords (a recipe's form)."""

    name = "convert"
    options_type = ConversionOptions

    def __init__(self, options: ConversionOptions | None = None, /, **fields: Any):
        self.options = options if options is not None else ConversionOptions(**fields)
        if options is not None and fields:
            self.options = replace(options, **fields)

    def call(self, model: OnnxModel) -> PassResult:
        options = self.options
        data = CalibrationData.of(options.calibration, model.proto, options.batch_size, options.held_out)
        data = rows_that_run(model, data)  # probed once here: the budget's many fits share the answer
        if options.min_fidelity is not None:
            return convert_within_budget(options, model, data, fit_and_recover)
        return fit_and_recover(model, options, data)

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
    rows.append(recovery.run(model, converted, options.progress))
    summary = replace(summary, seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb())
    return PassResult(model, result.modified, [*rows, summary])
