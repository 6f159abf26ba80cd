"""Sections ``convert``, ``convert_oneshot`` and ``convert_10000``: ``nmdeploy convert`` on the carried MiniLM on the
device (recovering 1000 steps, none, or the long run when the measured step rate says it fits), then the embedding
cosine against dense on both evaluation sets."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time
import traceback
from pathlib import Path

from gpu_check.common import FLOAT16_NOTE, progress
from gpu_check.plan import build_plan, convert_argv
from gpu_check.runner import Run, SectionSkipped, on_cuda


def carried_data(run: Run) -> dict[str, Path]:
    """The carried shard files of each data set, rebuilt as folders (what --calib/--data take) in the scratch."""
    folders = {}
    for name, entry in run.manifest["data"].items():
        folder = run.scratch / name
        if not folder.is_dir():
            folder.mkdir()
            # The smoke run converts on one shard (32 sentences): the code path, not the figure.
            for carried in entry["files"][:1] if run.smoke else entry["files"]:
                (folder / carried.split("-", 1)[1]).write_bytes((run.carry / carried).read_bytes())
        folders[name] = folder
    return folders


def _dense_minilm(run: Run) -> Path:
    """The carried MiniLM with its float16-stored weights cast back to float32."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    target = run.scratch / "minilm.onnx"
    if not target.is_file():
        entry = run.manifest["minilm"]
        proto = onnx.load(str(run.carry / entry["file"]))
        stored = set(entry["float16_stored"])
        for tensor in proto.graph.initializer:
            if tensor.name in stored:
                values = numpy_helper.to_array(tensor).astype(np.float32)
                tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
        onnx.save(proto, str(target))
    return target


def run_cli(argv: list[str], record: dict) -> tuple[int, str, str]:
    """``nmdeploy ARGV`` in this process: exit code (argparse's SystemExit included; 1 for an exception, whose
    traceback ends stderr), stdout, stderr. Interrupted (the section's time limit), what it had printed to stderr
    goes into ``record`` first."""
    from nmdeploy.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 2
            except Exception:
                traceback.print_exc()
                code = 1
    except BaseException:
        record["stderr_when_stopped"] = err.getvalue()[-2000:]
        raise
    return code, out.getvalue(), err.getvalue()


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def convert_minilm(run: Run, record: dict, steps: int | None) -> None:
    """Convert MiniLM's encoder weights on the device (recovering ``steps`` steps); when ``--device`` is rejected
    or the device run fails, once more without it (recorded); then the embedding cosine against dense on both
    evaluation sets."""
    from nmdeploy.evaluation.compare import compare_models

    dense = _dense_minilm(run)
    data = carried_data(run)
    out = run.scratch / f"minilm-2of4-{steps or 0}.onnx"
    out.unlink(missing_ok=True)
    device = "cuda" if on_cuda(run) else "cpu"
    argv = convert_argv(str(dense), str(out), str(data["calib"]), steps, device)
    record["argv"] = argv
    record["notes"] = [FLOAT16_NOTE]
    progress(f"convert: nmdeploy {' '.join(argv)}")
    started = time.perf_counter()
    code, stdout, stderr = run_cli(argv, record)
    record["ran_on"] = device
    if code:
        rejected = code == 2 and ("--device" in stderr or "unrecognized arguments" in stderr)
        record["device_flag"] = ("rejected: " if rejected else f"failed (exit {code}): ") + _last_line(stderr)
        if not rejected:
            record["device_stderr"] = stderr[-3000:]
        out.unlink(missing_ok=True)
        argv = convert_argv(str(dense), str(out), str(data["calib"]), steps, None)
        record["argv"] = argv
        progress(f"convert: --device {record['device_flag']}; again without it: nmdeploy {' '.join(argv)}")
        started = time.perf_counter()
        code, stdout, stderr = run_cli(argv, record)
        record["ran_on"] = "cpu (nmdeploy convert without --device)"
    record["wall_seconds"] = round(time.perf_counter() - started, 2)
    if code:
        record["stderr"] = stderr[-3000:]
        raise RuntimeError(f"nmdeploy convert exited with {code}: {_last_line(stderr)}")
    try:  # --json prints one document; anything printed before it is skipped
        document = json.loads(stdout[stdout.index("{") :])
    except ValueError:
        record["stdout_tail"] = stdout[-2000:]
        document = {}
    summary = document.get("summary", {})
    record["summary"] = {k: summary.get(k) for k in ("seconds", "total_seconds", "peak_rss_mb") if k in summary}
    report = document.get("report", [])
    record["converted_weights"] = sum(1 for r in report if r.get("step") == "convert" and not r.get("skipped"))
    recovery = next((r for r in report if r.get("step") == "recover"), None)
    if recovery is not None:
        record["recovery"] = recovery
        seconds, steps_run = recovery.get("seconds") or 0, recovery.get("steps_run") or 0
        if seconds and steps_run:
            record["steps_per_second"] = round(steps_run / seconds, 2)
            record["seconds_per_1000_steps"] = round(1000 * seconds / steps_run, 1)
    run.save()
    record["cosine"] = {}
    for name in ("other", "same"):
        comparison = compare_models(dense, out, data[name], outputs=[run.manifest["minilm"]["output"]])
        record["cosine"][name] = round(float(comparison.fidelity), 5)
        run.save()
    progress(
        f"convert: {record['converted_weights']} weights, cosine other kind {record['cosine']['other']:.4f}, same kind "
        f"{record['cosine']['same']:.4f}" + (f", {record.get('steps_per_second')} steps/s" if recovery else "")
    )


def convert_section(run: Run, record: dict) -> None:
    convert_minilm(run, record, build_plan(run.shapes, run.smoke)["convert"]["steps"])


def convert_oneshot_section(run: Run, record: dict) -> None:
    convert_minilm(run, record, None)


def convert_long_section(run: Run, record: dict) -> None:
    steps = run.long_steps or build_plan(run.shapes, run.smoke)["convert_10000"]["steps"]
    record["steps"] = steps
    short = run.results["sections"].get("convert")
    if short is None:  # asked for alone (a second call): no rate to plan by, so the section's limit decides
        convert_minilm(run, record, steps)
        return
    rate, wall = short.get("steps_per_second"), short.get("wall_seconds")
    if not rate or wall is None:
        raise SectionSkipped(f"the {short.get('status', 'missing')} 1000-step conversion gave no step rate to plan by")
    estimate = wall - short["recovery"]["seconds"] + steps / rate
    record["estimated_seconds"] = round(estimate, 1)
    left = signal.getitimer(signal.ITIMER_REAL)[0] or run.left()
    if estimate > left - 5:
        raise SectionSkipped(f"needs about {estimate:.0f} s at {rate} steps/s, {left:.0f} s left")
    convert_minilm(run, record, steps)
