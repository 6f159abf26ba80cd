"""Small files that declare huge sizes are refused before anything is allocated for them: one line, exit 2, the size
named, in under a second, peak memory within 200 MB of the verb's own start-up.

The cases run in one fresh interpreter that first imports what the verbs import (their start-up); the peak memory it
reports per case is the growth of the process's peak over that case, so pages a huge allocation touches show there.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_bad_inputs import folder_state, mlp

ROOT = Path(__file__).resolve().parent.parent
# One interpreter runs every case (imports cost seconds): it imports what the verbs import, then for each case notes
# its peak memory so far, calls the CLI in-process with stderr captured, and reports the time and the new peak.
DRIVER = """
import contextlib, io, json, resource, sys, time
import numpy, onnx, onnxruntime, torch, nmdeploy.cli
for verb in ("inspect", "prune", "convert", "compare", "run", "train", "regress"):
    __import__(f"nmdeploy.cli.{verb}")
import nmdeploy.conversion.controller, nmdeploy.conversion.recipes
import nmdeploy.calibration.statistics.engine, nmdeploy.train.trainer
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stderr = io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stderr(stderr):
        try:
            code = nmdeploy.cli.main(argv)
        except BaseException as error:
            code = repr(error)
    elapsed = time.perf_counter() - began
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) / 1024
    results[name] = {"code": code, "seconds": elapsed, "grew_mb": grew, "stderr": stderr.getvalue()}
print(json.dumps(results))
"""


def no_data_behind_dims(folder: Path) -> Path:
    proto = mlp()
    tensor = proto.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.dims[:] = [2**20, 2**20]
    return save(proto, folder)


def undefined_type(folder: Path) -> Path:
    proto = mlp()
    proto.graph.initializer[0].data_type = TensorProto.UNDEFINED
    return save(proto, folder)


def value_info_of_1e12(folder: Path) -> Path:
    proto = mlp()
    proto.graph.value_info.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, [10**12, 32]))
    return save(proto, folder)


def input_of_1e9_rows(folder: Path) -> Path:
    proto = mlp()
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 10**9
    return save(proto, folder)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | str) -> bytes:
    """A length-delimited protobuf field (written by hand: protobuf itself will not build what it cannot parse)."""
    payload = payload.encode() if isinstance(payload, str) else payload
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _graph(name: str, node: bytes, output: str) -> bytes:  # GraphProto: node 1, name 2, output 12
    return _field(1, node) + _field(2, name) + _field(12, _field(1, output))


def _if(output: str, then_branch: bytes, else_branch: bytes) -> bytes:  # NodeProto: input 1, output 2, op 4, attr 5
    attributes = b"".join(
        _field(5, _field(1, name) + _field(6, graph) + _varint(20 << 3) + _varint(5))  # type GRAPH
        for name, graph in (("then_branch", then_branch), ("else_branch", else_branch))
    )
    return _field(1, "cond") + _field(2, output) + _field(4, "If") + attributes


def nested_ifs(depth: int):
    def build(folder: Path) -> Path:
        """``depth`` If nodes, each holding the next in its then branch; every else branch passes x through."""
        leaf = _graph("leaf", _field(1, "x") + _field(2, "o0") + _field(4, "Identity"), "o0")
        inner = leaf
        for level in range(1, depth):
            inner = _graph(f"g{level}", _if(f"o{level}", inner, leaf), f"o{level}")
        graph = (
            _graph("nested", _if("y", inner, leaf), "y") + _field(11, _field(1, "x")) + _field(11, _field(1, "cond"))
        )
        opset = _field(8, _varint(2 << 3) + _varint(17))
        path = folder / "model.onnx"
        path.write_bytes(_varint(1 << 3) + _varint(10) + opset + _field(7, graph))
        return path

    build.__name__ = f"if_nested_{depth}_deep"
    return build


def save(proto: onnx.ModelProto, folder: Path) -> Path:
    path = folder / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def npz_declaring_1e12_rows(folder: Path) -> Path:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 16)})
    path = folder / "calib.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue() + bytes(128))
    return path


def deep_toml(folder: Path, name: str, depth: int = 100_000) -> Path:
    path = folder / name
    path.write_text("x = " + "[" * depth + "]" * depth + "\n")
    return path


def large_toml(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("# padding\n" * 2_000_000 + '[task]\nname = "digits-cnn"\n')
    return path


def good_model(folder: Path) -> Path:
    return save(mlp(), folder)


BOMBS = {
    "inspect-no_data_behind_2^40_dims": (lambda f: ["inspect", no_data_behind_dims(f)], "1099511627776 elements"),
    "prune-no_data_behind_2^40_dims": (lambda f: ["prune", no_data_behind_dims(f), "-o", f / "o.onnx"], "stores 0"),
    "convert-no_data_behind_2^40_dims": (
        lambda f: ["convert", no_data_behind_dims(f), "-o", f / "o.onnx", "--calib", "random"],
        "1099511627776 elements",
    ),
    "inspect-undefined_type": (lambda f: ["inspect", undefined_type(f)], "UNDEFINED"),
    "inspect-value_info_of_1e12": (lambda f: ["inspect", value_info_of_1e12(f)], "128000000000000 bytes"),
    "convert-value_info_of_1e12": (
        lambda f: ["convert", value_info_of_1e12(f), "-o", f / "o.onnx", "--calib", "random"],
        "[1000000000000, 32]",
    ),
    "convert-random_of_1e9_rows": (
        lambda f: ["convert", input_of_1e9_rows(f), "-o", f / "o.onnx", "--calib", "random"],
        "64000000000 bytes",
    ),
    "compare-random_of_1e9_rows": (
        lambda f: ["compare", input_of_1e9_rows(f), input_of_1e9_rows(f), "--data", "random"],
        "64000000000 bytes",
    ),
    "convert-npz_declaring_1e12_rows": (
        lambda f: ["convert", good_model(f), "-o", f / "o.onnx", "--calib", npz_declaring_1e12_rows(f)],
        "64000000000000 bytes",
    ),
    "compare-npz_declaring_1e12_rows": (
        lambda f: ["compare", good_model(f), good_model(f), "--data", npz_declaring_1e12_rows(f)],
        "[1000000000000, 16]",
    ),
    "run-recipe_nested_100000_deep": (
        lambda f: ["run", deep_toml(f, "recipe.toml"), good_model(f), "-o", f / "o.onnx"],
        "nested too deeply",
    ),
    "train-config_of_20_MB": (
        lambda f: ["train", large_toml(f, "config.toml"), "-o", f / "run", "--no-progress"],
        "20000027 bytes",
    ),
    "regress-baselines_nested_100000_deep": (
        lambda f: ["regress", deep_toml(f, "baselines.toml")],
        "nested too deeply",
    ),
    "inspect-if_nested_200_deep": (lambda f: ["inspect", nested_ifs(200)(f)], "nested"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Every bomb run once, in one interpreter; each case's folder state before and after."""
    root = tmp_path_factory.mktemp("bombs")
    argvs, states = {}, {}
    for name, (build, _) in BOMBS.items():
        folder = root / name.replace("^", "")
        folder.mkdir()
        argvs[name] = [str(a) for a in build(folder)]
        states[name] = (folder, folder_state(folder))
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    return {name: (reports[name], folder_state(folder) == before) for name, (folder, before) in states.items()}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_resource_bomb_is_refused_quickly_without_allocating(name, refusals):
    report, unchanged = refusals[name]
    # --calib/--data random print their usual warning first; the refusal is the one error line.
    lines = [line for line in report["stderr"].splitlines() if line.strip() and not line.startswith("[WARNING]")]
    assert report["code"] == 2 and len(lines) == 1, report
    assert BOMBS[name][1] in lines[0], lines[0]
    assert report["seconds"] < 1.0, report
    assert report["grew_mb"] < 200, report
    assert unchanged
