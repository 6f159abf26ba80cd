"""Weight discovery on hand-built graphs: every storage form and every path from storage to a GEMM."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import nonzero_positions, to_torch, transposable_axes
from nmdeploy.masks import is_nm, is_transposable
from nmdeploy.passes import prune

FLOAT = TensorProto.FLOAT


def make_model(nodes, inputs, outputs, initializers=(), functions=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], functions=list(functions), ir_version=10
    )


def value(name, shape, dtype=FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def init(name, shape, dtype=np.float32):
    return numpy_helper.from_array(np.random.default_rng(0).standard_normal(shape).astype(dtype), name)


def prune_and_run(model, folder):
    """Prune with nmdeploy, check every pruned weight along its traced axis, and run the result in ONNX Runtime."""
    onnx.save(model, folder / "model.onnx")
    loaded = OnnxModel.load(folder / "model.onnx")
    pruned_names = {row["weight"] for row in prune(loaded, pattern="2:4").report_json() if "skipped" not in row}
    assert pruned_names
    loaded.save(folder / "pruned.onnx")
    stored = OnnxModel.load(folder / "pruned.onnx")
    for weight in find_prunable_weights(stored.proto).weights:
        if weight.name in pruned_names:
            nonzero = nonzero_positions(stored.read, weight, to_torch(stored.read(weight.tensor)))
            if weight.needs_transposable:
                axis, out_axis = transposable_axes(weight)
                assert is_transposable(nonzero, "2:4", axis=axis, out_axis=out_axis).fraction == 1.0
            else:
                assert is_nm(nonzero, "2:4", weight.axis).fraction == 1.0
    session = ort.InferenceSession(str(folder / "pruned.onnx"))
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else 2 for d in spec.shape]
        boolean = spec.type == "tensor(bool)"
        feeds[spec.name] = np.ones(shape, bool) if boolean else rng.standard_normal(shape).astype(np.float32)
    for output in session.run(None, feeds):
        assert np.isfinite(output).all()


def only_weight(report):
    assert len(report.weights) == 1, report
    return report.weights[0]


@pytest.mark.parametrize("trans_b,axis", [(0, 0), (1, 1)])
def test_gemm_b_axis_follows_transb(trans_b, axis, tmp_path):
    shape = [16, 8] if trans_b == 0 else [8, 16]
    model = make_model(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], transB=trans_b, name="fc")],
        [value("x", [2, 16])],
        [value("y", [2, 8])],
        [init("W", shape), init("b", [8])],
    )
    weight = only_weight(find_prunable_weights(model))
    assert (weight.name, weight.kind, weight.axis, weight.shape) == ("W", "initializer", axis, tuple(shape))
    assert weight.uses[0].node == "fc" and weight.uses[0].input_index == 1
    prune_and_run(model, tmp_path)


def test_gemm_a_side_weight_with_transa(tmp_path):
    model = make_model(
        [helper.make_node("Gemm", ["W", "x"], ["y"], transA=1)],
        [value("x", [16, 2])],
        [value("y", [8, 2])],
        [init("W", [16, 8])],
    )
    assert only_weight(find_prunable_weights(model)).axis == 0
    prune_and_run(model, tmp_path)


@pytest.mark.parametrize("shape,axis", [([16, 8], 0), ([3, 16, 8], 1), ([2, 3, 16, 8], 2)])
def test_matmul_b_reduces_over_its_second_to_last_axis(shape, axis, tmp_path):
    model = make_model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [value("x", [*shape[:-2], 2, 16])],
        [value("y", [*shape[:-2], 2, 8])],
        [init("W", shape)],
    )
    assert only_weight(find_prunable_weights(model)).axis == axis
    prune_and_run(model, tmp_path)


def test_matmul_a_side_weight_reduces_over_its_last_axis(tmp_path):
    model = make_model(
        [helper.make_node("MatMul", ["W", "x"], ["y"])],
        [value("x", [16, 2])],
        [value("y", [8, 2])],
        [init("W", [8, 16])],
    )
    assert only_weight(find_prunable_weights(model)).axis == 1
    prune_and_run(model, tmp_path)


def test_transpose_cast_identity_are_followed_and_the_axis_remapped(tmp_path):
    nodes = [
        helper.make_node("Cast", ["W"], ["W32"], to=FLOAT),
        helper.make_node("Transpose", ["W32"], ["Wt"], perm=[1, 0]),
        helper.make_node("Identity", ["Wt"], ["Wi"]),
        helper.make_node("MatMul", ["x", "Wi"], ["y"]),
    ]
    model = make_model(nodes, [value("x", [2, 16])], [value("y", [2, 8])], [init("W", [8, 16], np.float16)])
    weight = only_weight(find_prunable_weights(model))
    # MatMul reduces over axis 0 of the [16, 8] transposed value, which is axis 1 of the stored [8, 16] tensor.
    assert (weight.axis, weight.dtype, weight.uses[0].path) == (1, "float16", ("Cast", "Transpose", "Identity"))
    prune_and_run(model, tmp_path)


def test_conv_weights_and_grouped_and_depthwise_convs(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["a"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "W2"], ["b"], name="grouped", group=2),
        helper.make_node("Conv", ["b", "W3"], ["y"], name="depthwise", group=8),
    ]
    model = make_model(
        nodes,
        [value("x", [1, 4, 8, 8])],
        [value("y", None)],
        [init("W1", [8, 4, 3, 3]), init("W2", [8, 4, 1, 1]), init("W3", [8, 1, 3, 3])],
    )
    report = find_prunable_weights(model)
    assert {w.name: w.axis for w in report.weights} == {"W1": 1, "W2": 1}
    assert [(u.node, "depthwise" in u.reason) for u in report.untraced] == [("depthwise", True)]
    prune_and_run(model, tmp_path)


def test_conv_transpose_reduces_over_input_channels(tmp_path):
    model = make_model(
        [helper.make_node("ConvTranspose", ["x", "W"], ["y"])],
        [value("x", [1, 8, 4, 4])],
        [value("y", None)],
        [init("W", [8, 4, 3, 3])],
    )
    assert only_weight(find_prunable_weights(model)).axis == 0
    prune_and_run(model, tmp_path)


def test_constant_node_weights_and_subgraphs(tmp_path):
    constant = helper.make_node("Constant", [], ["Wc"], value=init("ignored", [16, 8]))
    then_graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "Wc"], ["t"], name="in_then"),
        ],
        "then",
        [],
        [value("t", [2, 8])],
    )
    inner_const = helper.make_node("Constant", [], ["We"], value=init("inner", [16, 8]))
    else_graph = helper.make_graph(
        [inner_const, helper.make_node("MatMul", ["x", "We"], ["e"], name="in_else")], "else", [], [value("e", [2, 8])]
    )
    nodes = [
        constant,
        helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_graph, else_branch=else_graph),
    ]
    model = make_model(nodes, [value("x", [2, 16]), value("cond", [], TensorProto.BOOL)], [value("y", [2, 8])])
    report = find_prunable_weights(model)
    by_name = {w.name: w for w in report.weights}
    assert set(by_name) == {"Wc", "We"}
    assert by_name["Wc"].kind == "constant" and by_name["Wc"].graph == "main"  # stored outside, used inside
    assert by_name["Wc"].uses[0].graph == "main/branch:then_branch"
    assert by_name["We"].graph == "main/branch:else_branch" and by_name["We"].axis == 0
    prune_and_run(model, tmp_path)


def test_quantize_dequantize_chains_lead_to_the_float_weight(tmp_path):
    nodes = [
        helper.make_node("QuantizeLinear", ["W", "scale", "zero"], ["Wq"]),
        helper.make_node("DequantizeLinear", ["Wq", "scale", "zero"], ["Wdq"]),
        helper.make_node("Gemm", ["x", "Wdq"], ["y"], transB=1),
    ]
    inits = [
        init("W", [8, 16]),
        numpy_helper.from_array(np.array(0.1, np.float32), "scale"),
        numpy_helper.from_array(np.array(0, np.int8), "zero"),
    ]
    model = make_model(nodes, [value("x", [2, 16])], [value("y", [2, 8])], inits)
    weight = only_weight(find_prunable_weights(model))
    assert (weight.name, weight.axis, weight.uses[0].path) == ("W", 1, ("QuantizeLinear", "DequantizeLinear"))
    prune_and_run(model, tmp_path)


def test_integer_weight_behind_dequantize_linear(tmp_path):
    nodes = [
        helper.make_node("DequantizeLinear", ["Wq", "scale"], ["W"]),
        helper.make_node("MatMul", ["x", "W"], ["y"]),
    ]
    inits = [init("Wq", [16, 8], np.int8), numpy_helper.from_array(np.array(0.1, np.float32), "scale")]
    model = make_model(nodes, [value("x", [2, 16])], [value("y", [2, 8])], inits)
    weight = only_weight(find_prunable_weights(model))
    assert (weight.name, weight.dtype, weight.axis) == ("Wq", "int8", 0)
    prune_and_run(model, tmp_path)


def test_shared_weight_with_different_axes_needs_a_transposable_mask(tmp_path):
    # Tied embedding: E [vocab=16, hidden=8] used as MatMul(x, E) (axis 0) and MatMul(h, E^T) (axis 1).
    nodes = [
        helper.make_node("MatMul", ["x", "E"], ["h"], name="down"),
        helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Et"], ["y"], name="up"),
    ]
    model = make_model(nodes, [value("x", [2, 16])], [value("y", [2, 16])], [init("E", [16, 8])])
    weight = only_weight(find_prunable_weights(model))
    assert weight.needs_transposable and weight.axis is None and weight.axes == (0, 1)
    same_axis = make_model(
        [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("MatMul", ["x", "W"], ["b"])],
        [value("x", [2, 16])],
        [value("a", None), value("b", None)],
        [init("W", [16, 8])],
    )
    shared = only_weight(find_prunable_weights(same_axis))
    assert not shared.needs_transposable and len(shared.uses) == 2
    prune_and_run(model, tmp_path)


def test_activations_are_not_weights_and_untraceable_constants_say_why():
    nodes = [
        helper.make_node("MatMul", ["x", "z"], ["a"]),  # activation x activation
        helper.make_node("Mul", ["W", "s"], ["Ws"]),
        helper.make_node("MatMul", ["x", "Ws"], ["b"], name="scaled"),
        helper.make_node("Reshape", ["R", "shape"], ["Rr"]),
        helper.make_node("MatMul", ["x", "Rr"], ["c"], name="reshaped"),
    ]
    inits = [
        init("W", [16, 8]),
        numpy_helper.from_array(np.array(2.0, np.float32), "s"),
        init("R", [128]),
        numpy_helper.from_array(np.array([16, 8], np.int64), "shape"),
    ]
    model = make_model(
        nodes, [value("x", [2, 16]), value("z", [16, 8])], [value("a", None), value("b", None), value("c", None)], inits
    )
    report = find_prunable_weights(model)
    assert report.weights == ()
    reasons = {u.node: u.reason for u in report.untraced}
    assert set(reasons) == {"scaled", "reshaped"}
    assert "Mul" in reasons["scaled"] and "fold constants" in reasons["scaled"]
    assert "Reshape" in reasons["reshaped"] and "splits or merges" in reasons["reshaped"]
    assert {u.node: u.foldable for u in report.untraced} == {"scaled": "Ws", "reshaped": "Rr"}


def test_initializer_that_is_also_a_graph_input_is_not_constant():
    model = make_model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        [value("x", [2, 16]), value("W", [16, 8])],
        [value("y", [2, 8])],
        [init("W", [16, 8])],
    )
    report = find_prunable_weights(model)
    assert report.weights == () and "graph input with a default initializer" in report.untraced[0].reason


def test_weights_inside_local_functions(tmp_path):
    body = [
        helper.make_node("Constant", [], ["Wf"], value=init("f", [16, 8])),
        helper.make_node("MatMul", ["inp", "Wf"], ["h"], name="inner"),
        helper.make_node("MatMul", ["h", "Wp"], ["out"], name="passed"),
    ]
    function = helper.make_function("custom", "Block", ["inp", "Wp"], ["out"], body, [helper.make_opsetid("", 17)])
    model = make_model(
        [helper.make_node("Block", ["x", "W"], ["y"], domain="custom")],
        [value("x", [2, 16])],
        [value("y", [2, 4])],
        [init("W", [8, 4])],
        functions=[function],
    )
    model.opset_import.append(helper.make_opsetid("custom", 1))
    report = find_prunable_weights(model)
    assert [(w.name, w.graph, w.axis) for w in report.weights] == [("Wf", "function:custom.Block", 0)]
    assert [u.node for u in report.untraced] == ["passed"]
    assert "inline local functions" in report.untraced[0].reason
    prune_and_run(model, tmp_path)


def test_transpose_axis_is_mapped_through_perm_not_its_inverse(tmp_path):
    # Stored T [8, 4, 16]; Transpose(perm=[2, 0, 1]) gives X [16, 8, 4]; batched MatMul reduces X's axis -2 (size 8),
    # which is T's axis perm[1] = 0. (The inverse permutation would point at T's axis 2, of size 16.)
    nodes = [helper.make_node("Transpose", ["T"], ["X"], perm=[2, 0, 1]), helper.make_node("MatMul", ["x", "X"], ["y"])]
    model = make_model(nodes, [value("x", [16, 2, 8])], [value("y", [16, 2, 4])], [init("T", [8, 4, 16])])
    weight = only_weight(find_prunable_weights(model))
    assert weight.axis == 0 and weight.shape[weight.axis] == 8
    prune_and_run(model, tmp_path)


@pytest.mark.parametrize(
    "stored,target,axis",
    [
        ([2, 16, 8], [32, 8], None),  # merges the reduction axis (K=16) with a batch axis: not provable
        ([16, 8, 1], [16, 8], 0),  # drops a trailing 1: K is kept
        ([1, 16, 8], [0, 16, -1], 1),  # 0 copies, -1 infers; MatMul B [1, 16, 8] reduces over axis -2 = stored axis 1
    ],
)
def test_reshape_is_followed_only_where_it_keeps_the_axis(stored, target, axis, tmp_path):
    nodes = [
        helper.make_node("Reshape", ["W", "shape"], ["Wr"], name="reshape"),
        helper.make_node("MatMul", ["x", "Wr"], ["y"], name="mm"),
    ]
    inits = [init("W", stored), numpy_helper.from_array(np.array(target, np.int64), "shape")]
    model = make_model(nodes, [value("x", [2, 16])], [value("y", None)], inits)
    report = find_prunable_weights(model)
    if axis is None:
        assert report.weights == () and "splits or merges" in report.untraced[0].reason
    else:
        weight = only_weight(report)
        assert (weight.name, weight.axis, weight.uses[0].path) == ("W", axis, ("Reshape",))
        prune_and_run(model, tmp_path)


def test_sparse_initializer_weight_is_reported_not_taken_for_an_activation():
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "S")
    indices = numpy_helper.from_array(np.array([0, 5], np.int64), "S_indices")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "S"], ["y"], name="mm")],
        "g",
        [value("x", [2, 4])],
        [value("y", [2, 2])],
        sparse_initializer=[helper.make_sparse_tensor(values, indices, [4, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    report = find_prunable_weights(model)
    assert report.weights == ()
    assert [(u.node, u.input_index) for u in report.untraced] == [("mm", 1)]
    assert "sparse initializer" in report.untraced[0].reason


def test_a_cyclic_graph_is_a_one_line_error_and_a_cycle_inside_a_subgraph_is_reported(tmp_path, capsys):
    from nmdeploy.cli import main

    nodes = [
        helper.make_node("Identity", ["b"], ["a"], name="first"),
        helper.make_node("Identity", ["a"], ["b"], name="second"),
        helper.make_node("MatMul", ["x", "a"], ["y"], name="mm"),
    ]
    model = make_model(nodes, [value("x", [2, 16])], [value("y", [2, 8])])
    onnx.save(model, tmp_path / "cyclic.onnx")
    before = (tmp_path / "cyclic.onnx").read_bytes()
    assert main(["prune", str(tmp_path / "cyclic.onnx"), "-o", str(tmp_path / "out.onnx")]) == 2
    assert not (tmp_path / "out.onnx").exists() and (tmp_path / "cyclic.onnx").read_bytes() == before
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "cycle through Identity node" in error and "Traceback" not in error
    # The same cycle inside an If branch: the main graph is acyclic, the walk reports the weight instead of looping.
    branch = helper.make_graph(nodes, "then", [], [value("y", [2, 8])])
    nested = make_model(
        [helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)],
        [value("x", [2, 16]), value("cond", [], TensorProto.BOOL)],
        [value("out", [2, 8])],
    )
    report = find_prunable_weights(nested)
    assert report.weights == () and {u.reason for u in report.untraced} == {
        "'a' is computed in a cycle; an ONNX graph must be acyclic"
    }


def test_chains_deeper_than_the_recursion_limit_are_walked(tmp_path):
    """A 24-layer transformer export has producer chains of thousands of nodes: deciding whether an operand is
    constant must not recurse once per node."""
    depth = 3000
    nodes = [helper.make_node("Relu", ["x" if i == 0 else f"r{i - 1}"], [f"r{i}"]) for i in range(depth)]
    nodes += [helper.make_node("Mul", ["W" if i == 0 else f"c{i - 1}", "s"], [f"c{i}"]) for i in range(depth)]
    nodes.append(helper.make_node("MatMul", [f"r{depth - 1}", f"r{depth - 1}"], ["activations"]))
    nodes.append(helper.make_node("MatMul", [f"r{depth - 1}", f"c{depth - 1}"], ["y"], name="computed"))
    inits = [init("W", [16, 8]), numpy_helper.from_array(np.array(1.0, np.float32), "s")]
    model = make_model(nodes, [value("x", [2, 16])], [value("activations", None), value("y", None)], inits)
    report = find_prunable_weights(model)
    assert report.weights == ()
    assert [(u.node, u.foldable) for u in report.untraced] == [("computed", f"c{depth - 1}")]
