"""The main job: take the bundled reference models through the whole deployment pipeline and check the result.

For each model: export (digits: trained first, in seconds) -> inspect -> calibrated 2:4 conversion -> fp16 cast ->
compare with the dense model (-> with ``precision`` int8 or fp8: INT8 / FP8 Q/DQ by the quantize step of the
recipe tensorrt-2of4-<precision>, or, with a fidelity floor, by the conversion's own precision budget, compared with
the dense model too) -> dense-vs-2:4 latency on ONNX Runtime ->
regression check against ``models/<name>/baselines.toml``; with TensorRT and a CUDA GPU it also builds a sparse
strongly typed engine of the fp16 (or Q/DQ) model and reports which layers ran sparse, in which precision. Every
artefact lands in ``out_dir/<name>/``; ``out_dir/summary.{json,md}`` sum it up.

The baselines files name their models relative to a pipeline model folder (``dense.onnx``, ``converted-2of4.onnx``,
``evaluation``), and the regression step resolves them against ``out_dir/<name>/``. Compare and bench are measured
once: the regression step judges the same figures rather than measuring again.

``run_user_pipeline`` (``nmdeploy pipeline MODEL --calib DATA --data EVAL``) runs the same steps on a user's model
(``pipeline/user.py``); ``pipeline/run.py`` holds the one code path both take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress import LatencySettings
from nmdeploy.pipeline.models import (
    BASELINES,
    CAST,
    CONVERTED,
    DENSE,
    EVALUATION,
    PRECISIONS,
    PREPARE,
    PreparedModel,
    check_precision,
)
from nmdeploy.pipeline.render import engine_lines, summary_line, summary_markdown, summary_table
from nmdeploy.pipeline.report import ModelReport, PipelineReport
from nmdeploy.pipeline.run import ModelJob, Progress, run_jobs
from nmdeploy.pipeline.steps import ConvertSettings, engine_skip_reason, regress
from nmdeploy.pipeline.user import run_user_pipeline
from nmdeploy.reference import MODELS_FOLDER

__all__ = [
    "CAST",
    "CONVERTED",
    "DENSE",
    "MODELS",
    "PRECISIONS",
    "ConvertSettings",
    "ModelReport",
    "PipelineReport",
    "PreparedModel",
    "engine_lines",
    "engine_skip_reason",
    "regress",
    "run_pipeline",
    "run_user_pipeline",
    "summary_line",
    "summary_markdown",
    "summary_table",
]

MODELS = ("digits", "minilm")


def run_pipeline(
    out_dir: str | Path,
    *,
    models: Sequence[str] = MODELS,
    update_baselines: bool = False,
    baselines_dir: str | Path = MODELS_FOLDER,
    progress: Progress | None = None,
    fidelity: ConvertSettings | None = None,
    precision: str = "fp16",
    quantize: Mapping[str, Any] | None = None,
) -> PipelineReport:
    """Run every step for each of ``models`` into ``out_dir`` and judge it against ``baselines_dir/<name>/``.

    ``update_baselines`` rewrites the baselines with the measured figures (deliberately, tolerances kept).
    ``progress`` receives one line per step; when it is given, the long steps also draw bars on a terminal.
    ``fidelity`` turns on recovery and/or the fidelity budget in the conversion step. ``precision`` (fp16, int8,
    fp8) is what the engine step deploys; int8 and fp8 add the quantize step and its comparison (with a fidelity
    floor, the conversion's precision budget writes the Q/DQ model instead of the quantize step); ``quantize``
    (QuantizePass keywords: range method, smoothing, ...) replaces the recipe's options for the 8-bit layers.
    """
    check_precision(precision)
    unknown = [name for name in models if name not in MODELS]
    if unknown or not models:
        raise InputError(f"unknown model(s) {unknown or '(none)'}; choose from {', '.join(MODELS)}")
    baselines = {name: Path(baselines_dir) / name / BASELINES for name in models}
    missing = [str(path) for path in baselines.values() if not path.is_file()]
    if missing:
        raise InputError(f"no baselines file {missing[0]}: pass --baselines DIR, a folder holding MODEL/baselines.toml")
    out = Path(out_dir)
    jobs = [
        ModelJob(
            name,
            out / name,
            partial(PREPARE[name], out / name),
            dense=out / name / DENSE,
            evaluation=out / name / EVALUATION,
            baselines=baselines[name],
            root=out / name,
            latency=LatencySettings(batch=(1, 32)),
        )
        for name in dict.fromkeys(models)
    ]
    return run_jobs(
        out, jobs, update=update_baselines, progress=progress, settings=fidelity, precision=precision, quantize=quantize
    )
