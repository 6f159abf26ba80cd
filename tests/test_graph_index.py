"""The graph index on hand-built graphs: producers, consumers through subgraphs, order and cycles, slices and cuts
(checked by running the model segment by segment), stored tensors by identity, dtypes, and edits."""

import itertools

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import nmdeploy
from nmdeploy.graph import dtypes
from nmdeploy.graph.attributes import model_tensors
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.order import GraphCycleError
from nmdeploy.graph.scope import SUBGRAPH, Use

FLOAT = TensorProto.FLOAT


def value(name, shape, dtype=FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def array(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def make_model(nodes, inputs, outputs, initializers=(), functions=(), sparse=()):
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, initializer=list(initializers), sparse_initializer=list(sparse)
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], functions=list(functions), ir_version=10
    )
    return model


def nested_model():
    """x -> Relu -> a; b = a + 1; If(cond) then: [Loop body reads b from two scopes out] + a, else: own c * 2."""
    loop_body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["carried", "b"], ["carried_out"], name="loop_add"),
        ],
        "body",
        [value("i", [], TensorProto.INT64), value("cond_in", [], TensorProto.BOOL), value("carried", [2, 3])],
        [value("cond_out", [], TensorProto.BOOL), value("carried_out", [2, 3])],
    )
    then_graph = helper.make_graph(
        [
            helper.make_node("Loop", ["trip", "", "a"], ["looped"], name="loop", body=loop_body),
            helper.make_node("Add", ["looped", "a"], ["then_out"], name="then_add"),
        ],
        "then",
        [],
        [value("then_out", [2, 3])],
        initializer=[numpy_helper.from_array(np.array(2, np.int64), "trip")],
    )
    else_graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(array([2, 3], 5), "c")),
            helper.make_node("Mul", ["c", "b"], ["else_out"], name="else_mul"),
        ],
        "else",
        [],
        [value("else_out", [2, 3])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Add", ["a", "one"], ["b"], name="add_one"),
        helper.make_node("If", ["cond"], ["picked"], name="branch", then_branch=then_graph, else_branch=else_graph),
        helper.make_node("Mul", ["picked", "a"], ["y"], name="out_mul"),
    ]
    return make_model(
        nodes,
        [value("x", [2, 3]), value("cond", [], TensorProto.BOOL)],
        [value("y", [2, 3])],
        [numpy_helper.from_array(np.ones([2, 3], np.float32), "one")],
    )


def test_producers_and_consumers_include_reads_from_nested_subgraphs():
    model = nested_model()
    index = GraphIndex(model)
    main = index.main
    assert index.producer("b") is model.graph.node[1]
    assert index.producer("x") is None
    # 'a' is read by add_one, by the If (then_add and the Loop's initial value) and by out_mul.
    assert main.consumers("a") == [Use(1, 0), Use(2, SUBGRAPH), Use(3, 1)]
    # 'b' is only read two scopes down (the Loop body) and in the else branch: one SUBGRAPH use of the If.
    assert main.consumers("b") == [Use(2, SUBGRAPH)]
    assert index.outer_reads(model.graph.node[2]) == {"a", "b"}  # not 'c', 'trip' or 'looped': defined inside
    assert main.reads(2) == ["cond", "a", "b"]
    then_scope = next(scope for scope in index.scopes if scope.name == "main/branch:then_branch")
    loop = then_scope.producer("looped")
    assert index.outer_reads(loop) == {"b"}
    assert index.locate(loop) == (then_scope, 0)
    assert then_scope.lookup("b").scope is main and then_scope.lookup("trip").kind == "initializer"
    body = next(scope for scope in index.scopes if scope.name.endswith("loop:body"))
    assert body.parent is then_scope and body.owner is loop
    assert body.free_names == {"b"}
    assert [scope.name for scope in index.scopes] == [
        "main",
        "main/branch:else_branch",  # attributes in stored order (make_node sorts them by name)
        "main/branch:then_branch",
        "main/branch:then_branch/loop:body",
    ]


def cycle_model():
    nodes = [
        helper.make_node("Add", ["x", "q"], ["p"], name="first"),
        helper.make_node("Relu", ["p"], ["q"], name="second"),
        helper.make_node("Relu", ["x"], ["y"], name="free"),
    ]
    return make_model(nodes, [value("x", [2])], [value("y", [2])])


def test_topological_order_keeps_a_sorted_graph_and_sorts_an_unsorted_one():
    model = nested_model()
    assert GraphIndex(model).topological_order() == [0, 1, 2, 3]
    shuffled = list(model.graph.node)
    order = [3, 2, 1, 0]
    del model.graph.node[:]
    model.graph.node.extend(shuffled[k] for k in order)
    index = GraphIndex(model)
    names = [index.nodes[k].name for k in index.topological_order()]
    assert names == ["relu", "add_one", "branch", "out_mul"]  # the If waits for 'b', read only in its subgraphs


def test_a_cycle_is_one_line_error_of_the_nmdeploy_family():
    index = GraphIndex(cycle_model())
    with pytest.raises(GraphCycleError) as caught:
        index.topological_order()
    assert isinstance(caught.value, nmdeploy.Error)
    message = str(caught.value)
    assert "\n" not in message and "cycle" in message and "2 nodes" in message


def test_a_node_reading_its_own_output_is_a_cycle():
    model = make_model([helper.make_node("Add", ["x", "p"], ["p"])], [value("x", [2])], [value("p", [2])])
    with pytest.raises(GraphCycleError):
        GraphIndex(model).topological_order()


def test_backward_slice_follows_subgraph_reads_and_stops_where_told():
    model = nested_model()
    index = GraphIndex(model)
    assert index.backward_slice(["picked"]) == [0, 1, 2]  # the If needs 'b' for its subgraphs
    assert index.backward_slice(["picked"], stop=["b"]) == [0, 2]
    assert index.backward_slice(["b"], stop=["a"]) == [1]
    assert index.backward_slice(["x", "one"]) == []


def run(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


def segment_model(model, index, order, start, end):
    """The nodes order[start:end] as a model: inputs are the graph inputs and what is live at ``start``; outputs
    what is live at ``end``."""
    live_in = index.live_values(start, order) if start else []
    live_out = index.live_values(end, order) if end < len(order) else [o.name for o in model.graph.output]
    nodes = [model.graph.node[k] for k in order[start:end]]
    inputs = [*model.graph.input, *(helper.make_empty_tensor_value_info(name) for name in live_in)]
    graph = helper.make_graph(
        nodes,
        "segment",
        inputs,
        [helper.make_empty_tensor_value_info(name) for name in live_out],
        initializer=list(model.graph.initializer),
    )
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version), live_out


@pytest.mark.parametrize("condition", [True, False])
def test_running_segment_by_segment_on_live_values_gives_the_whole_model_output(condition):
    model = nested_model()
    feeds = {"x": array([2, 3], 1), "cond": np.array(condition)}
    (expected,) = run(model, feeds)
    index = GraphIndex(model)
    order = index.topological_order()
    assert index.live_values(1, order) == ["a"]
    assert index.live_values(2, order) == ["a", "b"]
    assert index.live_values(3, order) == ["a", "picked"]
    for cuts in itertools.combinations(range(1, len(order)), 2):
        values = dict(feeds)
        bounds = [0, *cuts, len(order)]
        for start, end in itertools.pairwise(bounds):
            segment, outputs = segment_model(model, index, order, start, end)
            feeds_here = {name: values[name] for name in [i.name for i in segment.graph.input]}
            values.update(zip(outputs, run(segment, feeds_here), strict=True))
        np.testing.assert_array_equal(values["y"], expected)


def test_graph_outputs_are_live_to_the_end_and_segment_inputs_list_outside_reads():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["x"], ["y"])],
        [value("x", [2])],
        [value("h", [2]), value("y", [2])],
    )
    index = GraphIndex(model)
    assert index.live_values(1) == ["h"]  # read by nobody, but an output of the graph
    assert GraphIndex(nested_model()).segment_inputs([1, 2]) == ["a", "one", "cond"]


def stored_model():
    inner = helper.make_graph(
        [helper.make_node("Add", ["x", "w_sub"], ["t"])],
        "then",
        [],
        [value("t", [2])],
        initializer=[numpy_helper.from_array(array([2], 3), "w_sub")],
    )
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([1.5], np.float32), "w_sparse"),
        numpy_helper.from_array(np.array([1], np.int64), "w_sparse_indices"),
        [2],
    )
    body = [
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(array([2], 4), "k")),
        helper.make_node("Add", ["inp", "k"], ["out"]),
    ]
    function = helper.make_function("custom", "Shift", ["inp"], ["out"], body, [helper.make_opsetid("", 17)])
    nodes = [
        helper.make_node("Constant", [], ["w_const"], value=numpy_helper.from_array(array([2], 1), "ignored")),
        helper.make_node("Constant", [], ["scalar"], value_float=2.0),
        helper.make_node("Add", ["x", "w_init"], ["s1"]),
        helper.make_node("Add", ["s1", "w_const"], ["s2"]),
        helper.make_node("Add", ["s2", "w_sparse"], ["s3"]),
        helper.make_node("Add", ["s3", "w_default"], ["s4"]),
        helper.make_node("If", ["cond"], ["s5"], then_branch=inner, else_branch=inner),
        helper.make_node("Shift", ["s4"], ["y"], domain="custom"),
    ]
    model = make_model(
        nodes,
        [value("x", [2]), value("cond", [], TensorProto.BOOL), value("w_default", [2])],
        [value("y", [2]), value("s5", [2])],
        [numpy_helper.from_array(array([2], 2), "w_init"), numpy_helper.from_array(array([2], 6), "w_default")],
        functions=[function],
        sparse=[sparse],
    )
    model.opset_import.append(helper.make_opsetid("custom", 1))
    return model


def test_stored_tensors_with_their_storage_joined_by_identity():
    model = stored_model()
    index = GraphIndex(model)
    graph = model.graph
    initializer = index.stored("w_init")
    assert initializer.storage == "initializer" and initializer.tensor is graph.initializer[0]
    constant = index.stored("w_const")
    assert constant.storage == "constant" and constant.node is graph.node[0]
    assert constant.tensor is graph.node[0].attribute[0].t
    sparse = index.stored("w_sparse")
    assert sparse.storage == "sparse_initializer" and sparse.sparse is graph.sparse_initializer[0]
    assert index.stored("w_default") is None  # an initializer that is also an input is only a default
    assert index.stored("scalar") is None and index.stored("s1") is None and index.stored("x") is None
    then_scope = index.scopes[1]
    assert index.stored("w_sub", then_scope).scope is then_scope
    assert index.stored("w_init", then_scope).tensor is graph.initializer[0]  # found from inside, stored outside
    everything = {(s.scope.name, s.name, s.storage, s.overridable) for s in index.stored_tensors()}
    assert everything == {
        ("main", "w_init", "initializer", False),
        ("main", "w_default", "initializer", True),
        ("main", "w_sparse", "sparse_initializer", False),
        ("main", "w_const", "constant", False),
        ("main/If_6:then_branch", "w_sub", "initializer", False),
        ("main/If_6:else_branch", "w_sub", "initializer", False),
        ("function:custom.Shift", "k", "constant", False),
    }
    tensors = list(model_tensors(model))
    stored_ids = {id(s.tensor) for s in index.stored_tensors()}
    assert stored_ids <= {id(t) for t in tensors}
    assert len(tensors) == 8  # also the sparse indices


def test_the_dtype_table_follows_onnx_and_rejects_unknown_types():
    assert dtypes.numpy_dtype(TensorProto.FLOAT) == np.float32
    assert dtypes.numpy_dtype(TensorProto.BFLOAT16) == ml_dtypes.bfloat16
    assert dtypes.numpy_dtype(TensorProto.FLOAT8E4M3FN) == ml_dtypes.float8_e4m3fn
    assert dtypes.torch_dtype(TensorProto.BFLOAT16) is torch.bfloat16
    assert dtypes.torch_dtype(TensorProto.FLOAT8E5M2) is torch.float8_e5m2
    assert dtypes.from_type_string("tensor(float16)") == TensorProto.FLOAT16
    assert dtypes.numpy_dtype_of_string("tensor(bool)") == np.bool_
    assert dtypes.type_name(TensorProto.BFLOAT16) == "bfloat16"
    for code in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT8, TensorProto.BOOL):
        assert dtypes.onnx_type(dtypes.numpy_dtype(code)) == code
    for bad in (lambda: dtypes.numpy_dtype(TensorProto.UNDEFINED), lambda: dtypes.numpy_dtype(999)):
        with pytest.raises(dtypes.UnknownDtypeError):
            bad()
    with pytest.raises(dtypes.UnknownDtypeError):
        dtypes.from_type_string("seq(tensor(float))")
    with pytest.raises(dtypes.UnknownDtypeError):
        dtypes.torch_dtype(TensorProto.STRING)
    assert issubclass(dtypes.UnknownDtypeError, nmdeploy.Error)


def test_edits_keep_the_index_consistent_and_the_model_runnable():
    model = nested_model()
    index = GraphIndex(model)
    assert index.consumers("y") == []
    scale = index.add_initializer(numpy_helper.from_array(np.array(3.0, np.float32), index.fresh_name("scale")))
    assert index.stored("scale").tensor is scale
    name = index.fresh_name("c")  # 'c' is taken inside the else branch
    assert name == "c_1"
    position = index.topological_order().index(1) + 1
    index.insert_nodes(position, [helper.make_node("Mul", ["b", "scale"], [name], name=index.fresh_name("scale_b"))])
    assert index.producer(name) is model.graph.node[2] and index.consumers("b") == [Use(2, 0), Use(3, SUBGRAPH)]
    out_mul = index.producer("y")
    index.set_input(out_mul, 1, name)
    assert index.consumers(name) == [Use(4, 1)] and index.consumers("a")[-1] == Use(3, SUBGRAPH)
    feeds = {"x": array([2, 3], 1), "cond": np.array(False)}
    a = np.maximum(feeds["x"], 0)
    (y,) = run(model, feeds)
    else_c = array([2, 3], 5)
    np.testing.assert_allclose(y, else_c * (a + 1) * ((a + 1) * 3), rtol=1e-6)
    index.remove_nodes([index.main.producers[name]])
    index.set_input(index.producer("y"), 1, "a")
    index.remove_initializer("scale")
    assert index.stored("scale") is None and index.producer(name) is None
    assert index.topological_order() == [0, 1, 2, 3]
    onnx.checker.check_model(model, full_check=True)


def test_changes_made_behind_the_index_back_are_seen_after_mark_stale():
    model = nested_model()
    index = GraphIndex(model)
    model.graph.node.append(helper.make_node("Neg", ["y"], ["z"]))
    index.mark_stale()
    assert index.producer("z") is model.graph.node[4] and index.consumers("y") == [Use(4, 0)]


def test_node_identity_holds_after_garbage_collection():
    import gc

    model = nested_model()
    index = GraphIndex(model)
    gc.collect()
    for position, node in enumerate(model.graph.node):
        assert index.locate(node) == (index.main, position) and index.nodes[position] is node


def test_model_inputs_take_their_dtype_from_the_table_and_an_untyped_input_is_an_error():
    from nmdeploy.runtimes.data import graph_inputs, random_batches

    model = make_model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
        [value("x", ["batch", 4], TensorProto.BFLOAT16)],
        [value("y", ["batch", 4])],
    )
    (spec,) = graph_inputs(model)
    assert spec.dtype == ml_dtypes.bfloat16 and spec.shape == (None, 4)  # not float32 any more
    batch = next(random_batches([spec]))
    assert batch["x"].dtype == ml_dtypes.bfloat16 and np.unique(batch["x"]).size > 10  # normal values, not integers
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED
    with pytest.raises(dtypes.UnknownDtypeError, match="input 'x'"):
        graph_inputs(model)
