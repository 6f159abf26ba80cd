"""The pipeline on a user's model: every input checked before anything is written, then the bundled models' steps.

The dense model and the data are read where they lie (nothing is copied into the output folder); a new baselines
file names them by paths relative to itself, so the output folder and the inputs can move together.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nmdeploy.calibration.data import CalibrationData
from nmdeploy.errors import InputError
from nmdeploy.evaluation.bench import batches_within
from nmdeploy.evaluation.regress import LatencySettings
from nmdeploy.fidelity import is_builtin_metric, load_metric
from nmdeploy.files import check_output_path
from nmdeploy.pipeline.models import BASELINES, CAST, CONVERTED, check_precision, quantized_name, user_model
from nmdeploy.pipeline.report import PipelineReport
from nmdeploy.pipeline.run import ModelJob, Progress, run_jobs
from nmdeploy.pipeline.steps import ConvertSettings, pipeline_entry
from nmdeploy.runtimes.batch_axes import model_batch_axes
from nmdeploy.runtimes.data import RANDOM, data_files, graph_inputs, load_batches

log = logging.getLogger(__name__)

DEFAULT_SECOND_BATCH = 8  # timed besides batch 1 when the evaluation data's batch size says nothing more


def run_user_pipeline(
    model: str | Path,
    *,
    calibration: str | Path,
    evaluation: str | Path,
    out_dir: str | Path,
    baselines: str | Path | None = None,
    settings: ConvertSettings | None = None,
    include: str | None = None,
    exclude: str | None = None,
    batch: Sequence[int] | None = None,
    update_baselines: bool = False,
    progress: Progress | None = None,
    precision: str = "fp16",
    quantize: Mapping[str, Any] | None = None,
) -> PipelineReport:
    """inspect, convert, cast, compare, bench and regress ``model`` into ``out_dir`` (``precision`` int8 or fp8:
    quantized after the conversion, on ``calibration``, or chosen per layer by the precision budget where
    ``settings`` give a fidelity floor, with the recipe's quantization options or ``quantize``, and compared).

    ``baselines`` (default ``out_dir/baselines.toml``) judges the run when it exists; otherwise a new one is written
    from the measured figures. ``batch`` sizes are timed (default: 1 and the largest batch up to the evaluation
    data's, or 8, whose one inference fits :data:`nmdeploy.evaluation.bench.CALL_BUDGET`). A
    ``module:function`` metric in ``settings`` is also compared and stored in a new baselines file.
    """
    settings = settings or ConvertSettings()
    check_precision(precision)
    model, out = Path(model), Path(out_dir)
    baselines = out / BASELINES if baselines is None else Path(baselines)
    evaluation_batch = check_user_inputs(
        model,
        Path(calibration),
        Path(evaluation),
        out,
        baselines,
        settings.outputs,
        precision,
        settings.batch_axes,
        None if settings.held_out is None else Path(settings.held_out),
    )
    # A measure other than auto (a built-in one such as perplexity or ctc, or the user's) is also checked in the
    # baselines as [model.accuracy.metric].
    metric = None if settings.metric == "auto" else settings.metric
    if metric is not None and not is_builtin_metric(metric):
        load_metric(metric)
    if batch is None:
        largest = evaluation_batch or DEFAULT_SECOND_BATCH
        batch = batches_within(model, largest, data=evaluation, batch_axes=settings.batch_axes)
    prepared = user_model(model, Path(calibration), Path(evaluation), out, include=include, exclude=exclude)
    job = ModelJob(
        prepared.name,
        out,
        lambda: prepared,
        dense=model,
        evaluation=Path(evaluation),
        baselines=baselines,
        root=None,
        # as trtexec times: at least 10 runs and 0.5 s per size
        latency=LatencySettings(batch=tuple(batch), batch_axes=dict(settings.batch_axes or {})),
        starter=True,
        prepare_step=None,
        metric=metric,
    )
    return run_jobs(
        out,
        [job],
        update=update_baselines,
        progress=progress,
        settings=settings,
        precision=precision,
        quantize=quantize,
    )


def check_user_inputs(
    model: Path,
    calibration: Path,
    evaluation: Path,
    out: Path,
    baselines: Path,
    outputs: Sequence[str] | None = None,
    precision: str = "fp16",
    batch_axes: dict[str, int | None] | None = None,
    held_out: Path | None = None,
) -> int | None:
    """One-line errors before anything is written: the model loads and has the ``outputs`` named, every data set
    (``held_out`` too, where given: real rows, none of them calibration files) fits its inputs, the artefacts can be
    written and overwrite no input, an existing baselines file reads. Returns the evaluation batch size."""
    from nmdeploy.graph.model import OnnxModel

    proto = OnnxModel.load(model).proto
    inputs, axes = graph_inputs(proto), model_batch_axes(proto, batch_axes)
    names = [value.name for value in proto.graph.output]
    unknown = [name for name in outputs or () if name not in names]
    if unknown:
        raise InputError(
            f"--outputs: {model} has no output '{unknown[0]}'; its outputs are {', '.join(repr(n) for n in names)}"
        )
    if str(evaluation) == RANDOM:
        raise InputError("--data random: the pipeline judges the conversion on real evaluation data; give an .npz")
    read = [model]
    own_rows = () if held_out is None else (("--held-out", held_out),)
    if held_out is not None:
        CalibrationData(calibration, proto, held_out=held_out)  # refuses random rows and files shared with --calib
        if held_out.resolve() == evaluation.resolve():
            log.warning(
                "--held-out is --data: the floor and recovery chose on these rows, so fidelity measured on them is "
                "what they aimed at; give --data rows of its own"
            )
    for flag, data in (("--calib", calibration), ("--data", evaluation), *own_rows):
        if str(data) == RANDOM:
            log.warning("--calib random: the conversion will run, but accuracy needs real calibration data")
            continue
        read += data_files(data)
        try:
            first = next(load_batches(data, inputs))
        except StopIteration:
            raise InputError(f"{flag} {data}: no batches") from None
    if calibration.resolve() == evaluation.resolve():
        log.warning(
            "--data is the calibration data: the conversion was fitted on it, so fidelity measured there overstates "
            "what unseen inputs get; hold some data out for --data"
        )
    if out.exists() and not out.is_dir():
        raise InputError(f"-o {out}: a file, not a folder; give the folder for the pipeline's artefacts")
    quantized = () if precision == "fp16" else (quantized_name(precision),)
    for name in (CONVERTED, CAST, *quantized, "summary.json"):
        check_output_path(out / name, inputs=read)
    if baselines.exists():
        if pipeline_entry(baselines, None, model, out / CONVERTED, evaluation) is None:
            # Judging only the file's other pairs would end PASSED without judging what this run produces.
            raise InputError(
                f"{baselines} has no [[model]] entry for this run's pair (reference {model}, candidate "
                f"{out / CONVERTED}, data {evaluation}); give another --baselines file, or none to write one"
            )
    else:
        check_output_path(baselines, inputs=read)
    return axes.rows(first, f"--data {evaluation}")
