"""One graph query for batch axes: the runtimes' full table and the fidelity measures' named axes come from the same
rule, so the two cannot disagree on a model (a stateful model, a CTC recogniser, inputs that name their batch
differently, a model of fixed shapes)."""

from onnx import TensorProto, helper

from nmdeploy.graph.batch_axes import graph_batch_axes
from nmdeploy.runtimes.batch_axes import model_batch_axes


def model(inputs, outputs, nodes=()):
    """A graph of Identity nodes: each output copies the input of the same position (shapes are what matter)."""
    nodes = list(nodes) or [
        helper.make_node("Identity", [inp[0]], [out[0]]) for inp, out in zip(inputs, outputs, strict=False)
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs],
    )
    return helper.make_model(graph)


def test_a_stateful_model_has_its_state_rows_on_axis_1_and_no_rows_in_a_scalar():
    proto = model(
        [("frame", ["B", 512]), ("sr", []), ("state", [2, "B", 128])],
        [("speech", ["B", 1]), ("sr_out", []), ("next_state", [2, "B", 128])],
    )
    found = graph_batch_axes(proto)
    assert found.inputs == {"frame": 0, "sr": None, "state": 1}
    assert found.outputs == {"speech": 0, "sr_out": None, "next_state": 1}
    assert found.named_output_axes() == {"speech": 0, "next_state": 1}
    assert model_batch_axes(proto).axes == found.axes
    assert model_batch_axes(proto, {"state": None}).axes["state"] is None


def test_a_ctc_output_names_its_batch_on_axis_1_and_unnamed_outputs_are_left_to_the_data():
    proto = model([("x", ["batch", 3, 32, "width"])], [("logits", ["time", "batch", 97]), ("features", [None, 64])])
    found = graph_batch_axes(proto)
    assert found.named_output_axes() == {"logits": 1}
    # The runtimes need an axis for every value: the one free axis of features, inferred, not named.
    assert found.outputs == {"logits": 1, "features": 0} and "features" not in found.named


def test_inputs_naming_their_batch_differently_follow_the_most_common_name():
    """The stricter of the two former rules: only the symbol most inputs start with names a batch axis (the fidelity
    measures used to accept any input's first symbol); an output carrying another is measured from the data."""
    proto = model(
        [("ids", ["batch", "seq"]), ("mask", ["batch", "seq"]), ("image", ["n", 3, 8, 8])],
        [("embedding", ["batch", 16]), ("pixels", ["n", 10]), ("tokens", ["seq", "batch", 4])],
        nodes=[
            helper.make_node("Identity", ["ids"], ["embedding"]),
            helper.make_node("Identity", ["image"], ["pixels"]),
            helper.make_node("Identity", ["mask"], ["tokens"]),
        ],
    )
    found = graph_batch_axes(proto)
    assert found.named_output_axes() == {"embedding": 0, "tokens": 1}
    assert found.outputs["pixels"] == 0 and "pixels" not in found.named


def test_a_fixed_shape_model_has_rows_on_axis_0_where_the_first_dimension_is_the_common_one():
    proto = model([("x", [8, 3]), ("y", [8, 5]), ("table", [100, 4])], [("out", [8, 2])])
    found = graph_batch_axes(proto)
    assert found.inputs == {"x": 0, "y": 0, "table": None}
    assert found.outputs == {"out": 0} and found.named_output_axes() == {}
