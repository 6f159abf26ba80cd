"""Concurrent nmdeploy processes on one folder: two writers of one output, and readers during an in-place commit.

Each trial uses real processes. Writers: two ``nmdeploy prune A|B -o out/model.onnx`` (models with external data, so
a commit is several renames) started together, each paused inside its commit (``NMDEPLOY_PAUSE_AT``) so that their
renames would interleave; the result must be all of A's result or all of B's. Readers: an
in-place ``prune --in-place`` of out/model.onnx paused for a moment between its renames (``NMDEPLOY_PAUSE_AT``),
while a reader process loads the model and reads every weight over and over; every load must be wholly the old
version or wholly the new one. Neither may leave a temporary behind.

    python benchmarks/concurrency.py --trials 100 --write
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PAUSE = "rename-1:0.3"  # between the data file's rename and the model's
_READER = """
import sys, time
from pathlib import Path
from nmdeploy.graph.model import OnnxModel
path, stop, versions = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
seen = []
while not stop.exists():
    model = OnnxModel.load(path)
    seen.append("|".join(f"{t.name}:{model.read(t).tobytes().hex()[:64]}" for t in model.proto.graph.initializer))
print("\\n".join(seen))
"""


def mlp(seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    weights = {"W1": rng.standard_normal((64, 64)).astype(np.float32), "W2": rng.standard_normal((64, 16))}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y"])]
    graph = helper.make_graph(
        nodes,
        f"mlp{seed}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def save(proto: onnx.ModelProto, path: Path) -> Path:
    """W1 (16 KB) in model.onnx.data, W2 (4 KB) inside the model file: a commit changes both files, so a reader that
    paired one version's model file with the other's data file would see it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, path, save_as_external_data=True, location="model.onnx.data", size_threshold=8192)
    return path


def nmdeploy(*args: object, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-c", "import sys; from nmdeploy.cli import console_main; sys.exit(console_main())"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([*command, *map(str, args)], env=environment, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def fingerprint(path: Path) -> str:
    """Every weight's values, as the reader script prints them."""
    from nmdeploy.graph.model import OnnxModel

    model = OnnxModel.load(path)
    return "|".join(f"{t.name}:{model.read(t).tobytes().hex()[:64]}" for t in model.proto.graph.initializer)


def leftovers(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".nmdeploy-" in name or name.startswith(".nmdeploy"))


class Setup:
    """Models A and B, the results of pruning each alone, and the fingerprints of both versions of an in-place prune."""

    def __init__(self, root: Path):
        self.root = root
        self.a, self.b = save(mlp(1), root / "a" / "model.onnx"), save(mlp(2), root / "b" / "model.onnx")
        self.expected = set()
        for source in (self.a, self.b):
            out = root / "alone" / source.parent.name / "model.onnx"
            out.parent.mkdir(parents=True)
            assert nmdeploy("prune", source, "-o", out).wait() == 0
            self.expected.add(fingerprint(out))
        self.dense, self.pruned = fingerprint(self.a), fingerprint(root / "alone" / "a" / "model.onnx")


def writers_trial(setup: Setup, trial: int) -> str | None:
    """Two writers of one output at once; None when the result is one whole version, else what went wrong."""
    out = setup.root / f"writers-{trial}"
    out.mkdir()
    target = out / "model.onnx"
    # A pauses after its first rename and B before its first, so without a lock B's renames land inside A's commit.
    pauses = ("rename-1:0.6", "journal:0.3")
    processes = [
        nmdeploy("prune", source, "-o", target, env={"NMDEPLOY_PAUSE_AT": pause})
        for source, pause in zip((setup.a, setup.b), pauses, strict=True)
    ]
    errors = [process.communicate()[1] for process in processes]
    if any(process.returncode for process in processes):
        return f"a writer failed: {errors}"
    if fingerprint(target) not in setup.expected:
        return "the output mixes the two writers' files"
    if leftovers(out):
        return f"temporaries left: {leftovers(out)}"
    shutil.rmtree(out)
    return None


def reader_trial(setup: Setup, trial: int) -> tuple[str | None, int]:
    """A reader loading over and over during an in-place commit; (None or what went wrong, loads that saw the commit
    in progress or after it)."""
    out = setup.root / f"reader-{trial}"
    shutil.copytree(setup.a.parent, out)
    stop = out.parent / f"stop-{trial}"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    reader = subprocess.Popen([sys.executable, "-c", _READER, out / "model.onnx", stop], env=environment,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)  # the reader is loading by now
    writer = nmdeploy("prune", out / "model.onnx", "-o", out / "model.onnx", "--in-place",
                      env={"NMDEPLOY_PAUSE_AT": PAUSE})  # fmt: skip
    error = writer.communicate()[1]
    time.sleep(0.2)
    stop.touch()
    seen = reader.communicate()[0].split()
    stop.unlink()
    if writer.returncode:
        return f"the writer failed: {error}", 0
    mixed = [s for s in seen if s not in (setup.dense, setup.pruned)]
    if mixed:
        return f"{len(mixed)} of {len(seen)} loads mixed the versions", 0
    if fingerprint(out / "model.onnx") != setup.pruned or leftovers(out):
        return "the in-place result is not the pruned model, or temporaries were left", 0
    shutil.rmtree(out)
    return None, sum(s == setup.pruned for s in seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--write", action="store_true", help="write the figures to BENCHMARKS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        setup = Setup(Path(scratch))
        began = time.perf_counter()
        writer_failures = [f for f in (writers_trial(setup, k) for k in range(args.trials)) if f]
        readers = [reader_trial(setup, k) for k in range(args.trials)]
        reader_failures = [f for f, _ in readers if f]
        seconds = time.perf_counter() - began
    text = (
        f"`python benchmarks/concurrency.py --trials {args.trials}` ({seconds:.0f} s): two concurrent `prune -o` "
        f"of one output (external data, journal commits): {len(writer_failures)} of {args.trials} trials mixed or "
        f"broken. A reader loading in a loop during a paused in-place commit ({PAUSE.replace(':', ' for ')} s): "
        f"{len(reader_failures)} of {args.trials} trials saw a mix; {sum(n for _, n in readers)} loads saw the new "
        f"version."
    )
    print(text)
    for failure in (writer_failures + reader_failures)[:10]:
        print("  ", failure)
    if args.write:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from report import machine, write_section

        write_section("concurrency", "## Concurrent writers and readers (`benchmarks/concurrency.py`)",
                      f"{machine()}.\n\n{text}")  # fmt: skip
    return 1 if writer_failures or reader_failures else 0


if __name__ == "__main__":
    sys.exit(main())
