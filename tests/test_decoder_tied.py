"""The lm_head rule on hand-made graphs: a GEMM weight whose stored table a Gather also reads (directly or through
Cast / DequantizeLinear), and an untied GEMM weight scoring the vocabulary into a graph output, are dense by default
in prune and inspect; a GEMM as wide as the vocabulary inside the model, or a head of another width, is not."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes import prune

VOCABULARY, WIDTH = 32, 16


def lm(path, *, tied: bool, through: str | None = None, after: str | None = None, classes: int = VOCABULARY):
    """ids -> Gather(table) -> MatMul(W) -> MatMul(Transpose(head)) -> logits; ``tied``: head is the table;
    ``through``: the Gather reads the table through a Cast or a Q/DQ pair; ``after``: "softcap" puts tanh(x / 30) *
    30 between the head and the logits, "relu" a Relu; ``classes``: the untied head's output width."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCABULARY, WIDTH)).astype(np.float32)
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), "W"),
    ]
    looked_up, nodes = "table", []
    if through == "Cast":
        nodes.append(helper.make_node("Cast", ["table"], ["table_cast"], to=TensorProto.FLOAT))
        looked_up = "table_cast"
    elif through == "QDQ":
        inits += [numpy_helper.from_array(np.float32(0.05), "scale"), numpy_helper.from_array(np.int8(0), "zero")]
        nodes += [
            helper.make_node("QuantizeLinear", ["table", "scale", "zero"], ["table_q"]),
            helper.make_node("DequantizeLinear", ["table_q", "scale", "zero"], ["table_dq"]),
        ]
        looked_up = "table_dq"
    head = "table"
    if not tied:
        inits.append(numpy_helper.from_array(rng.standard_normal((classes, WIDTH)).astype(np.float32), "head"))
        head = "head"
    scores = "logits" if after is None else "scores"
    nodes += [
        helper.make_node("Gather", [looked_up, "ids"], ["embedded"], name="/embed/Gather"),
        helper.make_node("MatMul", ["embedded", "W"], ["hidden"], name="/block/MatMul"),
        helper.make_node("Transpose", [head], ["head_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["hidden", "head_t"], [scores], name="/lm_head/MatMul"),
    ]
    if after == "softcap":
        inits.append(numpy_helper.from_array(np.float32(30.0), "cap"))
        nodes += [
            helper.make_node("Div", [scores, "cap"], ["capped"]),
            helper.make_node("Tanh", ["capped"], ["bounded"]),
            helper.make_node("Mul", ["bounded", "cap"], ["logits"]),
        ]
    elif after == "relu":
        nodes.append(helper.make_node("Relu", [scores], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "lm",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 8, classes])],
        inits,
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 19)]), path)
    return path


@pytest.mark.parametrize("through", [None, "Cast", "QDQ"])
def test_a_head_sharing_the_embedding_table_is_dense_by_default(tmp_path, through):
    model = OnnxModel.load(lm(tmp_path / "lm.onnx", tied=True, through=through))
    weights = {w.name: w for w in find_prunable_weights(model.proto).weights}
    assert weights["table"].embedding_lookups == ("/embed/Gather",)
    assert "Gather '/embed/Gather'" in weights["table"].dense_by_default
    assert weights["W"].dense_by_default is None
    rows = {row.weight: row for row in inspect_model(model).rows}
    assert rows["table"].dense_on_purpose == weights["table"].dense_by_default
    table = np.array(model.read(weights["table"].tensor))
    report = {row.weight: row for row in prune(model).report}
    assert report["table"].skipped.startswith("tied to the token embedding") and not report["W"].skipped
    np.testing.assert_array_equal(model.read(weights["table"].tensor), table)
    prune(model, sparse_lm_head=True)
    kept = np.array(model.read(weights["table"].tensor)) != 0
    assert (kept.reshape(VOCABULARY, WIDTH // 4, 4).sum(-1) == 2).all()  # 2:4 along the head's reduction axis


@pytest.mark.parametrize("after", [None, "softcap"])
def test_an_untied_head_scoring_the_vocabulary_is_dense_by_default(tmp_path, after):
    model = OnnxModel.load(lm(tmp_path / "lm.onnx", tied=False, after=after))
    weights = {w.name: w for w in find_prunable_weights(model.proto).weights}
    assert weights["head"].vocabulary_scores == "logits" and not weights["head"].embedding_lookups
    assert weights["head"].dense_by_default.startswith("the lm_head, scoring the vocabulary in 'logits'")
    assert weights["W"].vocabulary_scores is None and weights["W"].dense_by_default is None
    rows = {row.weight: row for row in inspect_model(model).rows}
    assert rows["head"].dense_on_purpose == weights["head"].dense_by_default
    head = np.array(model.read(weights["head"].tensor))
    report = {row.weight: row for row in prune(model).report}
    assert "--sparse-lm-head" in report["head"].skipped and not report["W"].skipped
    np.testing.assert_array_equal(model.read(weights["head"].tensor), head)
    prune(model, sparse_lm_head=True)
    kept = np.array(model.read(weights["head"].tensor)) != 0
    assert (kept.reshape(VOCABULARY, WIDTH // 4, 4).sum(-1) == 2).all()


@pytest.mark.parametrize(
    "shape", [{"classes": VOCABULARY // 2}, {"after": "relu"}], ids=["not-vocabulary-wide", "not-scores"]
)
def test_a_head_of_another_width_or_feeding_other_ops_is_pruned_like_any_weight(tmp_path, shape):
    model = OnnxModel.load(lm(tmp_path / "lm.onnx", tied=False, **shape))
    assert all(w.dense_by_default is None for w in find_prunable_weights(model.proto).weights)
    assert not [row for row in prune(model).report if row.skipped]
