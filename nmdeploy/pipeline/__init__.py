"""The main job: take the bundled reference models through the whole deployment pipeline and check the result.

For each model: export (digits: trained first, in seconds) -> inspect -> calibrated 2:4 conversion -> fp16 cast ->
compare with the dense model -> dense-vs-2:4 latency on ONNX Runtime -> regression check against
``models/<name>/baselines.toml``; with TensorRT and a CUDA GPU it also builds a sparse fp16 engine and reports
which layers ran sparse. Every artefact lands in ``out_dir/<name>/``; ``out_dir/summary.{json,md}`` sum it up.

The baselines files name their models relative to a pipeline model folder (``dense.onnx``, ``converted-2of4.onnx``,
``evaluation``), and the regression step resolves them against ``out_dir/<name>/``. Compare and bench are measured
once: the regression step judges the same figures rather than measuring again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from nmdeploy.errors import InputError
from nmdeploy.evaluation.compare import compare_models
from nmdeploy.evaluation.regress import LatencySettings, accuracy_figures, latency_figures
from nmdeploy.files import write_atomically
from nmdeploy.passes.convert import ConvertedWeight
from nmdeploy.pipeline.models import BASELINES, CAST, CONVERTED, DENSE, ENGINE, PREPARE, PreparedModel
from nmdeploy.pipeline.render import engine_lines, summary_line, summary_markdown, summary_table
from nmdeploy.pipeline.report import ModelReport, PipelineReport, comparison_dict, json_value, write_json
from nmdeploy.pipeline.steps import (
    FidelitySettings,
    bench_pair,
    build_engine_report,
    cast_to_fp16,
    convert,
    engine_skip_reason,
    inspect_file,
    labelled_accuracy,
    pipeline_entry,
    regress,
    torch_threads,
)
from nmdeploy.reference import MODELS_FOLDER

log = logging.getLogger(__name__)

__all__ = [
    "CAST",
    "CONVERTED",
    "DENSE",
    "MODELS",
    "ModelReport",
    "PipelineReport",
    "PreparedModel",
    "engine_lines",
    "engine_skip_reason",
    "regress",
    "run_pipeline",
    "summary_line",
    "summary_markdown",
    "summary_table",
]

MODELS = ("digits", "minilm")

Progress = Callable[[str], None]


def run_pipeline(
    out_dir: str | Path,
    *,
    models: Sequence[str] = MODELS,
    update_baselines: bool = False,
    baselines_dir: str | Path = MODELS_FOLDER,
    progress: Progress | None = None,
    fidelity: FidelitySettings | None = None,
) -> PipelineReport:
    """Run every step for each of ``models`` into ``out_dir`` and judge it against ``baselines_dir/<name>/``.

    ``update_baselines`` rewrites the baselines with the measured figures (deliberately, tolerances kept).
    ``progress`` receives one line per step; when it is given, the long steps also draw bars on a terminal.
    ``fidelity`` turns on recovery and/or the fidelity budget in the conversion step.
    """
    unknown = [name for name in models if name not in MODELS]
    if unknown or not models:
        raise InputError(f"unknown model(s) {unknown or '(none)'}; choose from {', '.join(MODELS)}")
    baselines = {name: Path(baselines_dir) / name / BASELINES for name in models}
    missing = [str(path) for path in baselines.values() if not path.is_file()]
    if missing:
        raise InputError(f"no baselines file {missing[0]}: pass --baselines DIR, a folder holding MODEL/baselines.toml")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: log.info("%s", line))
    engine_skip = engine_skip_reason()
    start = time.perf_counter()
    reports = [
        _run_model(
            name, out / name, baselines[name], update_baselines, engine_skip, say, progress is not None, fidelity
        )
        for name in dict.fromkeys(models)
    ]
    report = PipelineReport(out, reports, time.perf_counter() - start)
    write_atomically(out / "summary.json", json.dumps(report.as_dict(), indent=2, default=json_value) + "\n")
    write_atomically(out / "summary.md", summary_markdown(report))
    return report


def _run_model(
    name: str,
    folder: Path,
    baselines: Path,
    update: bool,
    engine_skip: str | None,
    say: Progress,
    bars: bool,
    fidelity: FidelitySettings | None = None,
) -> ModelReport:
    seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def step(label: str) -> Iterator[None]:
        say(f"{name}: {label} ...")
        begin = time.perf_counter()
        yield
        seconds[label] = round(time.perf_counter() - begin, 2)
        say(f"{name}: {label} done in {seconds[label]:.1f} s")

    folder.mkdir(parents=True, exist_ok=True)
    entry = pipeline_entry(baselines, folder)  # a mistake in the baselines file shows before the long steps
    with step("export"):
        prepared = PREPARE[name](folder)
    with torch_threads(1 if prepared.single_thread else None):
        with step("inspect"):
            dense_inspection = inspect_file(prepared.dense, folder / "inspect-dense.json")
        with step("convert"):
            conversion = convert(prepared, folder / CONVERTED, folder / "convert.json", bars, fidelity)
        with step("inspect converted"):
            converted_inspection = inspect_file(folder / CONVERTED, folder / "inspect-converted.json")
        with step("cast fp16"):
            cast = cast_to_fp16(folder / CONVERTED, folder / CAST, prepared.evaluation, folder / "cast.json")
        with step("compare"):
            comparison = compare_models(prepared.dense, folder / CONVERTED, prepared.evaluation)
            write_json(folder / "compare.json", comparison_dict(comparison))
        with step("bench (ONNX Runtime)"):
            latency = (
                entry.latency if entry is not None and entry.latency is not None else LatencySettings(batch=(1, 32))
            )
            bench = bench_pair(
                prepared.dense, folder / CONVERTED, prepared.evaluation, latency, folder / "bench.json", bars
            )
        with step("regress"):
            measured = {**accuracy_figures(comparison), **latency_figures(bench)}
            regression = regress(baselines, folder, entry, measured, update)
            write_json(folder / "regress.json", regression.as_dict())
        task = None
        if prepared.labelled is not None:
            with step("task accuracy"):
                task = {
                    label: labelled_accuracy(path, *prepared.labelled)
                    for label, path in (
                        ("dense", prepared.dense),
                        ("converted", folder / CONVERTED),
                        ("cast", folder / CAST),
                    )
                }
    with step("TensorRT engine"):
        engine = build_engine_report(prepared, folder / CAST, folder / ENGINE, engine_skip)
    summary = converted_inspection.summary()
    return ModelReport(
        name=name,
        folder=folder,
        classifier=prepared.classifier,
        weights=dense_inspection.summary()["weights"],
        converted=sum(1 for row in conversion if isinstance(row, ConvertedWeight) and not row.skipped),
        compliant=summary["compliant"],
        parameters_compliant=summary["parameters_compliant"],
        parameters=summary["parameters"],
        comparison=comparison.outputs[0].as_dict(),
        cast_comparison=cast.comparison.outputs[0].as_dict() if cast.comparison else {},
        cast_note=cast.upcast_reason,
        latency_ratios={ratio.batch: ratio.p50 for ratio in bench.ratios},
        task_accuracy=task,
        regression=regression,
        engine=engine,
        seconds=seconds,
    )
