"""An independent checker: polygraphy's `inspect sparsity` must agree that what nmdeploy prunes is 2:4.

Polygraphy understands initializers of Conv, Gemm and 2-D MatMul weights (through Transpose, Cast and Q/DQ), so the
models here stay within that; nmdeploy's wider coverage is tested on its own elsewhere.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import prune

pytest.importorskip("polygraphy")
POLYGRAPHY = Path(sys.executable).with_name("polygraphy")


def polygraphy_verdicts(path) -> dict[str, bool]:
    result = subprocess.run(
        [str(POLYGRAPHY), "inspect", "sparsity", str(path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    return {name: kind == "sparse" for kind, name in re.findall(r"Found (sparse|non-sparse) tensor: (\S+)", text)}


def conv_and_linear_model():
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "C"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Flatten", ["c"], ["f"]),
        helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0]),
        helper.make_node("MatMul", ["f", "W"], ["h"]),
        helper.make_node("Gemm", ["h", "G"], ["y"], transB=1),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 16, 3, 3)).astype(np.float32), "C"),
        numpy_helper.from_array(rng.standard_normal((32, 8 * 4 * 4)).astype(np.float32), "Wt"),
        numpy_helper.from_array(rng.standard_normal((12, 32)).astype(np.float16).astype(np.float32), "G"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12])],
        inits,
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow
def test_polygraphy_sees_every_pruned_weight_as_2of4(tmp_path):
    onnx.save(conv_and_linear_model(), tmp_path / "m.onnx")
    assert polygraphy_verdicts(tmp_path / "m.onnx") == {"C": False, "Wt": False, "G": False}
    model = OnnxModel.load(tmp_path / "m.onnx")
    prune(model, pattern="2:4")
    model.save(tmp_path / "pruned.onnx")
    assert polygraphy_verdicts(tmp_path / "pruned.onnx") == {"C": True, "Wt": True, "G": True}
