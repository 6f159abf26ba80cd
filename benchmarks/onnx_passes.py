"""ONNX pruning benchmark: nmdeploy prune against polygraphy surgeon prune, and nmdeploy at BERT-large scale.

All in one run on one machine:
* a 1024x1024 MatMul model and the real MiniLM-L6 export: both tools, whole process (wall time and peak RSS);
  nmdeploy, a bare ``onnx.load`` + ``onnx.save`` process, ``import torch`` alone and nmdeploy through ``main()``
  without the console script's exit-time ``gc.freeze()`` run in alternating rounds (median of ``--rounds``);
* a synthetic BERT-large-sized model (about 335 M parameters, external data): nmdeploy alone, as ratios to a
  plain ``onnx.load`` + ``onnx.save`` of the same model (wall time) and to the model's bytes (peak RSS).
``--baseline PYTHON`` adds another installation's nmdeploy (for example the main branch's environment) to the
same rounds, whole process and prune step, so a change is judged on same-run ratios.
Writes a table into BENCHMARKS.md between the ``onnx-passes`` markers.

    python benchmarks/onnx_passes.py [--no-large] [--no-write] [--rounds 5] [--baseline PYTHON]
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from report import machine, write_section

BIN = Path(sys.executable).parent
LOAD_SAVE = """
import sys, onnx
model = onnx.load(sys.argv[1])
external = len(sys.argv) > 3
onnx.save(model, sys.argv[2], save_as_external_data=external, location=sys.argv[2].rsplit('/', 1)[-1] + '.data')
"""


IMPORT_TORCH = "import torch"
# The verb through main(), as tests call it: no gc.freeze() before the interpreter's exit.
WITHOUT_FREEZE = "import sys; from nmdeploy.cli import main; sys.exit(main(sys.argv[1:]))"
# What a prune process imports before it reads the model, as -X importtime reports it (cumulative, per package).
IMPORT_PRUNE = "import nmdeploy.cli.prune"
IMPORT_PACKAGES = ("torch", "onnx", "onnxruntime", "numpy", "nmdeploy.graph", "nmdeploy.masks", "nmdeploy.passes")

STEP_REPEATS = 3
STEP_NMDEPLOY = f"""
import sys, time
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import PrunePass
best = float("inf")
for _ in range({STEP_REPEATS}):
    model = OnnxModel.load(sys.argv[1])
    start = time.perf_counter()
    PrunePass(pattern="2:4")(model)
    best = min(best, time.perf_counter() - start)
print(best)
"""
STEP_POLYGRAPHY = """
import sys, time, onnx
from polygraphy.tools.sparse import SparsityPruner
model = onnx.load(sys.argv[1])
start = time.perf_counter()
SparsityPruner(model).prune()
print(time.perf_counter() - start)
"""


def step_seconds(script: str, model: Path, python: str = sys.executable) -> float:
    """In-process time of the pruning step alone: no interpreter start-up, no model loading or saving."""
    result = subprocess.run([python, "-c", script, str(model)], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def measure(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of a command, via GNU time."""
    start = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "%M", *command], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {result.stderr[-2000:]}")
    peak_kb = int(result.stderr.strip().splitlines()[-1])
    return seconds, peak_kb / 1024


def alternating(commands: dict[str, list[str]], rounds: int) -> dict[str, tuple[float, float]]:
    """Each command once per round, in turn, ``rounds`` times: the median wall seconds and the largest peak RSS.
    Alternating spreads slow spells of a shared machine over all commands alike."""
    walls: dict[str, list[float]] = {name: [] for name in commands}
    peaks: dict[str, float] = dict.fromkeys(commands, 0.0)
    for _ in range(rounds):
        for name, command in commands.items():
            wall, peak = measure(command)
            walls[name].append(wall)
            peaks[name] = max(peaks[name], peak)
    return {name: (statistics.median(walls[name]), peaks[name]) for name in commands}


def matmul_model(path: Path) -> None:
    weight = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])],
        [numpy_helper.from_array(weight, "W")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)


def minilm_model(path: Path) -> None:
    from nmdeploy.reference.minilm import export_minilm_onnx

    export_minilm_onnx(path, dynamo=False)


def bert_large_model(path: Path) -> int:
    """A chain of MatMuls with BERT-large's Linear shapes (24 layers) plus its embedding table, external data."""
    rng = np.random.default_rng(0)
    hidden, inner, layers = 1024, 4096, 24
    nodes, inits, current = [], [], "x"
    shapes = [(hidden, hidden)] * 4 + [(hidden, inner), (inner, hidden)]
    for layer in range(layers):
        for k, shape in enumerate(shapes):
            name = f"layer{layer}.w{k}"
            inits.append(numpy_helper.from_array(rng.standard_normal(shape, dtype=np.float32), name))
            nodes.append(helper.make_node("MatMul", [current, name], [f"{name}.out"]))
            current = f"{name}.out"
    inits.append(numpy_helper.from_array(rng.standard_normal((30522, hidden), dtype=np.float32), "embeddings"))
    nodes.append(helper.make_node("Gather", ["embeddings", "ids"], ["emb"]))
    graph = helper.make_graph(
        nodes,
        "bert_large_like",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, hidden]),
            helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, hidden]),
        ],
        inits,
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path, save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return sum(int(np.prod(t.dims)) for t in inits)


def import_seconds() -> dict[str, float]:
    """Cumulative import time per package in a fresh process importing the prune verb (-X importtime)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORT_PRUNE], capture_output=True, text=True, check=True
    )
    found: dict[str, float] = {}
    for line in result.stderr.splitlines():
        parts = [part.strip() for part in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] in IMPORT_PACKAGES:
            found[parts[2]] = int(parts[1]) / 1e6
    return found


def compare_tools(name: str, model: Path, work: Path, rounds: int, baseline: str | None) -> list[str]:
    size_mb = sum(p.stat().st_size for p in model.parent.glob(model.name + "*")) / 2**20
    prune_args = ["prune", str(model), "-o", str(work / f"{name}-nmdeploy.onnx")]
    commands = {
        "ours": [str(BIN / "nmdeploy"), *prune_args],
        "base": [sys.executable, "-c", LOAD_SAVE, str(model), str(work / f"{name}-copy.onnx")],
        "torch": [sys.executable, "-c", IMPORT_TORCH],
        "unfrozen": [sys.executable, "-c", WITHOUT_FREEZE, *prune_args],
    }
    if baseline:
        commands["baseline"] = [str(Path(baseline).parent / "nmdeploy"), *prune_args]
    times = alternating(commands, rounds)
    ours, base = times["ours"], times["base"]
    theirs = measure([str(BIN / "polygraphy"), "surgeon", "prune", str(model), "-o", str(work / f"{name}-poly.onnx")])
    our_step, their_step = step_seconds(STEP_NMDEPLOY, model), step_seconds(STEP_POLYGRAPHY, model)
    baseline_step = step_seconds(STEP_NMDEPLOY, model, baseline) if baseline else None
    print(f"  {name}: {times}, polygraphy {theirs}, steps {our_step:.3f} {their_step:.3f} {baseline_step}", flush=True)

    def row(tool: str, measured: tuple[float, float], step: float | None = None, versus: str = "-") -> str:
        step_cells = f"{step:.3f} | {their_step / step:.0f}x" if step else "- | -"
        return (
            f"| {name} ({size_mb:.0f} MB) | {tool} | {measured[0]:.2f} | {measured[1]:.0f} | {versus} "
            f"| {measured[0] / base[0]:.2f} | {step_cells} |"
        )

    rows = [
        row("nmdeploy prune", ours, our_step, f"{theirs[0] / ours[0]:.1f}x"),
        row("nmdeploy prune through main(), no exit-time gc.freeze()", times["unfrozen"]),
    ]
    if baseline:
        rows.append(row("baseline nmdeploy prune (`--baseline`)", times["baseline"], baseline_step))
    return rows + [
        row("polygraphy surgeon prune", theirs, their_step, "1.0x"),
        row("onnx.load + onnx.save", base),
        row("`python -c 'import torch'` alone", times["torch"]),
    ]


def large(work: Path, rounds: int, baseline: str | None) -> list[str]:
    model = work / "bert-large.onnx"
    params = bert_large_model(model)
    size = sum(p.stat().st_size for p in work.glob("bert-large.onnx*"))
    prune_args = ["prune", str(model), "-o", str(work / "bl-pruned.onnx")]
    commands = {
        "ours": [str(BIN / "nmdeploy"), *prune_args],
        "base": [sys.executable, "-c", LOAD_SAVE, str(model), str(work / "bl-copy.onnx"), "external"],
    }
    if baseline:
        commands["baseline"] = [str(Path(baseline).parent / "nmdeploy"), *prune_args]
    times = alternating(commands, rounds)
    ours, base = times["ours"], times["base"]
    print(f"  bert-large-like: {times}, {size / 2**20:.0f} MB", flush=True)
    rows = [
        f"| BERT-large-like, {params / 1e6:.0f} M params, external data ({size / 2**20:.0f} MB) | nmdeploy prune "
        f"| {ours[0]:.2f} | {ours[1]:.0f} | - | {ours[0] / base[0]:.2f} | {ours[1] * 2**20 / size:.2f} |",
    ]
    if baseline:
        other = times["baseline"]
        rows.append(
            f"| same | baseline nmdeploy prune (`--baseline`) | {other[0]:.2f} | {other[1]:.0f} | - "
            f"| {other[0] / base[0]:.2f} | {other[1] * 2**20 / size:.2f} |"
        )
    return rows + [
        f"| same | onnx.load + onnx.save | {base[0]:.2f} | {base[1]:.0f} | - | 1.00 | {base[1] * 2**20 / size:.2f} |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-large", action="store_true", help="skip the 335 M parameter model")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the whole-process commands")
    parser.add_argument("--baseline", metavar="PYTHON", help="another environment's python whose nmdeploy to compare")
    args = parser.parse_args()
    load_start = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    work = Path(tempfile.mkdtemp(prefix="nmdeploy-bench-"))
    try:
        models = work / "in"
        models.mkdir()
        matmul_model(models / "matmul-1024.onnx")
        minilm_model(models / "minilm-l6.onnx")
        rows = [
            "| model | tool | wall s | peak RSS MB | whole-process speed-up vs polygraphy | wall / load+save "
            "| prune step s (in-process) | prune-step speed-up vs polygraphy |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        rows += compare_tools("1024x1024 MatMul", models / "matmul-1024.onnx", work, args.rounds, args.baseline)
        rows += compare_tools("MiniLM-L6", models / "minilm-l6.onnx", work, args.rounds, args.baseline)
        large_rows = []
        if not args.no_large:
            large_rows = [
                "",
                "| model | tool | wall s | peak RSS MB | - | wall / load+save | peak RSS / model bytes |",
                "|---|---|---:|---:|---|---:|---:|",
            ] + large(work, min(args.rounds, 3), args.baseline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    imports = import_seconds()
    import_line = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in imports.items())
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"] * 3
    section = (
        f"Measured {datetime.date.today().isoformat()} on {machine()}, load average {load_start} at the start and "
        f"{' '.join(load)} at the end.\n"
        "Whole processes (interpreter start-up and model I/O included), 2:4 magnitude pruning; load+save is a "
        "bare python process doing onnx.load + onnx.save of the same model. nmdeploy, load+save, `import torch` and "
        f"nmdeploy through `main()` (no exit-time `gc.freeze()`) ran in {args.rounds} alternating rounds (the "
        f"335 M model: {min(args.rounds, 3)}), median wall time; polygraphy once. The in-process prune step of "
        f"nmdeploy is the best of {STEP_REPEATS} runs in one process (millisecond timings are exposed to preemption "
        "on a shared machine); polygraphy's is one run of seconds.\n\n" + "\n".join(rows + large_rows) + "\n\n"
        f"Start-up of `{IMPORT_PRUNE}` in a fresh process (`-X importtime`, cumulative, first importer of each "
        f"package): {import_line}; torch {'imported' if 'torch' in imports else 'not imported'}. "
        "`nmdeploy --help` and `--version` import none of them."
    )
    print(section)
    if not args.no_write:
        write_section("onnx-passes", "## ONNX pruning (`python benchmarks/onnx_passes.py`)", section)


if __name__ == "__main__":
    main()
