"""The finite-values check of weights reads one tensor at a time and widens it to float64 a piece at a time, so a
large external tensor (a decoder's lm_head) costs its own float32 read and not three times that; a bad value in any
piece is still found."""

import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import nmdeploy.graph.model as model_module
from nmdeploy.errors import InputError
from nmdeploy.graph.model import OnnxModel

ROWS, COLUMNS = 1024, 4096  # 16 MB of float32: four pieces of the check


def model_with_weight(folder, values):
    """x [batch, ROWS] @ w [ROWS, COLUMNS], w in an external data file."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", ROWS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", COLUMNS])],
        [numpy_helper.from_array(values, "w")],
    )
    path = folder / "m.onnx"
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    return OnnxModel.load(path)


def weights(bad=None, at=-1):
    values = np.random.default_rng(0).standard_normal((ROWS, COLUMNS)).astype(np.float32)
    if bad is not None:
        values.reshape(-1)[at] = bad
    return values


def test_the_check_never_holds_a_float64_copy_of_the_whole_tensor(tmp_path):
    model = model_with_weight(tmp_path, weights())
    tensor_bytes = ROWS * COLUMNS * 4
    assert tensor_bytes >= 2 * 8 * model_module.FINITE_CHECK_PIECE  # the tensor spans several pieces
    tracemalloc.start()
    try:
        model.check_finite(model.proto.graph.initializer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The float32 read plus two float64 pieces (the next one is made before the last is let go): 32 MB here, where a
    # whole float64 copy and its absolute values made it 80 MB.
    assert peak < tensor_bytes + 3 * model_module.FINITE_CHECK_PIECE * 8, peak


@pytest.mark.parametrize("at", [0, ROWS * COLUMNS // 2 + 7, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_bad_value_in_any_piece_is_refused(tmp_path, bad, at):
    model = model_with_weight(tmp_path, weights(bad, at))
    with pytest.raises(InputError, match="weight 'w' contains NaN or infinite values"):
        model.check_finite(model.proto.graph.initializer)
    if np.isnan(bad):
        with pytest.raises(InputError, match="weight 'w' contains NaN; fix the model first"):
            model.check_finite(model.proto.graph.initializer, allow_infinite=True)
    else:  # infinities allowed (attention-mask constants): accepted
        model.check_finite(model.proto.graph.initializer, allow_infinite=True)


def test_finite_values_whose_sum_overflows_float64_are_refused(tmp_path):
    values = np.full((ROWS, COLUMNS), 1e308, np.float64)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [ROWS, COLUMNS])],
        [numpy_helper.from_array(values, "w")],
    )
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx", save_as_external_data=True, size_threshold=0)
    model = OnnxModel.load(tmp_path / "m.onnx")
    with pytest.raises(InputError, match="NaN or infinite values"):
        model.check_finite(model.proto.graph.initializer)
    model.check_finite(model.proto.graph.initializer, allow_infinite=True)  # no NaN: accepted
