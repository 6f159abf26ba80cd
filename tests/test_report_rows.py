"""Report rows are dataclasses; ``--json`` prints their ``to_json``. The JSON keeps the shape users script against:
fields in declaration order, optional fields only when set, a recipe's rows labelled with their pass."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.conversion.recipes import load_recipe
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.base import PassRow
from nmdeploy.passes.cast import AddedCast, CastNode, CastTensor
from nmdeploy.passes.conversion_report import ConversionSummary, ConvertedWeight
from nmdeploy.passes.fold import FoldedWeight
from nmdeploy.passes.permute import PermutedWeight
from nmdeploy.passes.prune import PrunedWeight
from nmdeploy.passes.verify import VerifiedWeight


def test_optional_fields_appear_only_when_set_and_order_follows_the_declaration():
    skipped = PrunedWeight("W", [8, 4], None, skipped="axis 0 has length 6, not a multiple of 4")
    assert skipped.to_json() == {"weight": "W", "shape": [8, 4], "axis": None, "skipped": skipped.skipped}
    pruned = PrunedWeight("W", [8, 4], 0, method="1-D", retained=0.75, changed=True)
    assert list(pruned.to_json()) == ["weight", "shape", "axis", "method", "retained", "changed"]
    assert ConvertedWeight("W", skipped="not TensorRT-eligible").to_json() == {
        "step": "convert",
        "weight": "W",
        "skipped": "not TensorRT-eligible",
    }
    summary = ConversionSummary(1.5, 3, 700.0)
    assert summary.to_json() == {"step": "summary", "seconds": 1.5, "converted": 3, "peak_rss_mb": 700.0}
    permuted = PermutedWeight("W", True, channels=8, producers=["n"], retained_before=0.6, retained_after=0.7,
                              converged=True, step="permute")  # fmt: skip
    assert list(permuted.to_json())[:3] == ["step", "weight", "permuted"]
    assert "step" not in PermutedWeight("W", False, skipped="shared input").to_json()
    assert CastNode("n", "Softmax", "fp32", "sensitive op").to_json()["item"] == "node"
    assert "reason" not in CastNode("n", "MatMul", "fp16", None).to_json()
    assert CastTensor("W", "fp16", 0, 0, shared_with_fp32=False).to_json()["item"] == "tensor"
    assert AddedCast("c", "x", "fp32").to_json() == {"item": "cast", "name": "c", "tensor": "x", "precision": "fp32"}
    assert PassRow("fold-constants", FoldedWeight("W", [4, 4])).to_json() == {
        "pass": "fold-constants",
        "folded": "W",
        "shape": [4, 4],
    }
    assert VerifiedWeight("W", 1, 1.0).to_json() == {"weight": "W", "axis": 1, "compliant": 1.0}


def _mlp(path):
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [
            numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W1"),
            numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "W2"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_a_recipe_reports_typed_rows_and_its_json_is_their_to_json(tmp_path, capsys):
    model = _mlp(tmp_path / "mlp.onnx")
    result = load_recipe("tensorrt-2of4")(OnnxModel.load(model))
    assert all(isinstance(row, PassRow) for row in result.report)
    pruned = [row.row for row in result.report if row.pass_name == "prune"]
    assert [type(row) for row in pruned] == [PrunedWeight, PrunedWeight]
    assert all(row.changed and 0.5 < row.retained < 1.0 for row in pruned)

    assert main(["run", "tensorrt-2of4", str(model), "-o", str(tmp_path / "out.onnx"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["report"]
    assert printed == result.report_json()
    printed_pruned = [row for row in printed if row["pass"] == "prune"]
    assert len(printed_pruned) == 2 and all("retained" in row and "skipped" not in row for row in printed_pruned)
