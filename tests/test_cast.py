"""The precision pass: valid fp16/bf16 models that ONNX Runtime runs, sensitive ops and I/O kept in fp32, accuracy
against the fp32 model, masks unchanged by casting, and the ``nmdeploy cast`` command."""

import json

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_onnx_prune import IR_VERSION, build_mlp

from nmdeploy.cli import main
from nmdeploy.conversion.recipes import load_recipe
from nmdeploy.evaluation.precision import cast_model_file
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.layer_norms import decomposed_layer_norms
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import PrunePass
from nmdeploy.passes.cast import CastPass, cast, round_to_precision, upcast_for_cpu

LOW = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


class TinyEncoder(torch.nn.Module):
    """A MiniLM-shaped encoder: embeddings, one post-norm transformer layer with GELU, a classifier head."""

    def __init__(self):
        super().__init__()
        self.embeddings = torch.nn.Embedding(100, 64)
        self.layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, activation="gelu")
        self.head = torch.nn.Linear(64, 10)

    def forward(self, ids):
        return self.head(self.layer(self.embeddings(ids)))


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """The encoder from torch's legacy exporter at opset 14 (LayerNorm decomposed) and 17 (LayerNormalization)."""
    torch.manual_seed(0)
    module = TinyEncoder().eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    folder = tmp_path_factory.mktemp("encoders")
    paths = {}
    for opset in (14, 17):
        paths[opset] = folder / f"encoder-{opset}.onnx"
        torch.onnx.export(
            module,
            (ids,),
            str(paths[opset]),
            dynamo=False,
            opset_version=opset,
            input_names=["ids"],
            output_names=["logits"],
            dynamic_axes={"ids": {0: "batch", 1: "tokens"}},
        )
    # The traced attention bakes the batch and token counts in, so the check data keeps the export's shape.
    data = folder / "ids"
    data.mkdir()
    for index in range(3):
        np.savez(data / f"{index}.npz", ids=np.random.default_rng(index).integers(0, 100, (2, 8)).astype(np.int64))
    return paths, data


def node_types(proto):
    """Element type of every tensor, after strict inference (which also proves the types are consistent)."""
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    graph = inferred.graph
    types = {t.name: t.data_type for t in graph.initializer}
    types.update({v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]})
    return types


@pytest.mark.parametrize("opset", [14, 17])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_encoder_casts_to_a_valid_model_close_to_fp32(encoders, tmp_path, opset, precision):
    paths, data = encoders
    original = onnx.load(str(paths[opset]))
    outcome = cast_model_file(paths[opset], tmp_path / "cast.onnx", precision=precision, data=data)
    proto = onnx.load(str(outcome.output))
    onnx.checker.check_model(proto, full_check=True)
    types = node_types(proto)

    # Every GEMM weight is a stored tensor of the target type feeding its GEMM directly, as TensorRT needs.
    weights = find_prunable_weights(proto).weights
    assert len(weights) == 5  # in-projection, out-projection, two feed-forward layers, head
    assert {w.dtype for w in weights} == {"float16" if precision == "fp16" else "bfloat16"}
    assert all(use.path == () for w in weights for use in w.uses)
    # Normalisations and softmax compute in fp32; the I/O is what it was.
    for node in proto.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax", "ReduceMean", "Pow", "Sqrt"):
            assert all(types[name] == TensorProto.FLOAT for name in node.output), node.name
        if node.op_type in ("MatMul", "Gemm"):
            assert types[node.output[0]] == LOW[precision], node.name
    if opset == 14:
        layer_norm = decomposed_layer_norms(GraphIndex(proto))
        assert len(layer_norm) == 14  # two LayerNorms of 7 nodes, Sub/Add/Div included
        assert all(types[proto.graph.node[i].output[0]] == TensorProto.FLOAT for i in layer_norm)
    assert [(v.name, v.type.tensor_type.elem_type) for v in proto.graph.output] == [("logits", TensorProto.FLOAT)]
    # Fidelity: node names, opsets and producer survive.
    assert {n.name for n in original.graph.node} <= {n.name for n in proto.graph.node}
    assert proto.opset_import == original.opset_import and proto.producer_name == original.producer_name

    (logits,) = outcome.comparison.outputs
    assert outcome.comparison.batches == 3 and logits.samples == 6
    if precision == "fp16":
        assert outcome.upcast_reason is None  # ONNX Runtime runs this fp16 model itself
        assert logits.mean_cosine > 0.99999 and logits.max_abs_error < 5e-3
    else:
        assert "bf16" in outcome.upcast_reason
        assert logits.mean_cosine > 0.9995 and logits.max_abs_error < 5e-2


def test_upcast_evaluation_rounds_like_the_cast_model(encoders):
    """Where ONNX Runtime runs the fp16 model itself, the upcast stand-in agrees with it to fp16 resolution."""
    paths, _ = encoders
    model = OnnxModel.load(paths[17])
    cast(model, precision="fp16")
    feeds = {"ids": np.random.default_rng(3).integers(0, 100, (2, 8)).astype(np.int64)}
    native = ort.InferenceSession(model.proto.SerializeToString()).run(None, feeds)[0]
    emulated = ort.InferenceSession(upcast_for_cpu(model.proto, "fp16").SerializeToString()).run(None, feeds)[0]
    reference = ort.InferenceSession(str(paths[17])).run(None, feeds)[0]
    assert np.abs(native - emulated).max() < 4e-3
    # The stand-in does round: it is not simply the fp32 model again.
    assert np.abs(emulated - reference).max() > 1e-5


def test_rounding_clamps_and_keeps_tiny_values_nonzero():
    values = np.array([1e6, -1e6, 1e-9, -1e-9, 0.0, -0.0, np.inf, np.nan, 1.0 + 2**-12, 3.0], dtype=np.float32)
    rounded, clamped, raised = round_to_precision(values, "fp16")
    expected = [65504, -65504, 2**-24, -(2**-24), 0, 0, np.inf, np.nan, 1.0, 3.0]
    np.testing.assert_array_equal(rounded.astype(np.float32), np.array(expected, dtype=np.float32))
    assert (clamped, raised) == (2, 2) and np.signbit(rounded[5])
    tiny = np.array([1e-45, -1e-45, 1e-39], dtype=np.float32)  # fp32 subnormals below bf16's smallest
    rounded, clamped, raised = round_to_precision(tiny, "bf16")
    assert rounded.dtype == ml_dtypes.bfloat16 and np.all(rounded != 0) and raised == 2
    assert np.array_equal(np.sign(rounded.astype(np.float32)), np.sign(tiny))


def masks_of(model):
    return {w.name: model.read(w.tensor).astype(np.float32) != 0 for w in find_prunable_weights(model.proto).weights}


def mlp_with_planted_groups(tmp_path):
    """An MLP whose first weight holds an fp32 tie, a value that underflows fp16, and a pair fp16 rounds together."""
    proto = build_mlp()
    w1 = numpy_helper.to_array(proto.graph.initializer[0]).copy()  # MatMul [16, 32]: groups run down axis 0
    w1[0:4, 0] = [0.5, 2.0, 0.5, 0.1]  # exact fp32 tie at the boundary: the lower index wins in both orders
    w1[4:8, 1] = [1e-9, 3e-9, 0.0, 0.0]  # the kept tiny values underflow fp16 unless the cast keeps them nonzero
    w1[8:12, 2] = [1.0, 2.0, 1.0001, 0.1]  # fp32 keeps 1.0001 (index 2); in fp16 it ties with 1.0 (index 0)
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(w1, "W1"))
    path = tmp_path / "mlp.onnx"
    onnx.save(proto, str(path))
    return path


def groups_of(array, axis):
    """The groups of 4 along ``axis``, one per row."""
    return np.moveaxis(array, axis, -1).reshape(-1, 4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_casting_keeps_masks_exactly_and_prune_after_cast_differs_only_at_rounding_ties(tmp_path, precision):
    path = mlp_with_planted_groups(tmp_path)
    prune = PrunePass(pattern="2:4")

    pruned_first = OnnxModel.load(path)
    prune(pruned_first)
    fp32_masks = masks_of(pruned_first)
    CastPass(precision=precision)(pruned_first)
    # Casting never creates or removes a zero: prune -> cast keeps exactly the masks ranked in fp32,
    # including the kept values of 1e-9 and 3e-9 that fp16 would round to zero.
    after_cast = masks_of(pruned_first)
    assert after_cast.keys() == fp32_masks.keys()
    assert all(np.array_equal(after_cast[name], fp32_masks[name]) for name in fp32_masks)
    assert fp32_masks["W1"][4:8, 1].tolist() == [True, True, False, False]

    cast_first = OnnxModel.load(path)
    CastPass(precision=precision)(cast_first)
    prune(cast_first)
    low_masks = masks_of(cast_first)
    original = OnnxModel.load(path)
    differing = 0
    for weight in find_prunable_weights(original.proto).weights:
        rounded = np.abs(round_to_precision(original.read(weight.tensor), precision)[0].astype(np.float32))
        magnitudes = groups_of(rounded, weight.axis)
        fp32_kept = groups_of(fp32_masks[weight.name], weight.axis)
        low_kept = groups_of(low_masks[weight.name], weight.axis)
        for group in np.nonzero((fp32_kept != low_kept).any(axis=1))[0]:
            differing += 1
            ordered = np.sort(magnitudes[group])[::-1]
            assert ordered[1] == ordered[2], (weight.name, magnitudes[group])  # a tie the rounding made
            # Either mask keeps the same rounded magnitudes: the tie is broken differently, nothing more.
            assert sorted(magnitudes[group][fp32_kept[group]]) == sorted(magnitudes[group][low_kept[group]])
    # The planted fp32 tie is resolved alike in both orders; the planted rounding tie is where they part.
    assert fp32_masks["W1"][0:4, 0].tolist() == low_masks["W1"][0:4, 0].tolist() == [True, True, False, False]
    assert fp32_masks["W1"][8:12, 2].tolist() == [False, True, True, False]
    assert low_masks["W1"][8:12, 2].tolist() == [True, True, False, False]
    assert differing >= 1


def test_keep_ops_and_keep_nodes(encoders, tmp_path):
    paths, data = encoders
    outcome = cast_model_file(
        paths[17], tmp_path / "all.onnx", precision="fp16", keep_ops=["LayerNormalization"], keep_nodes="head",
        keep_io=False, data=data,
    )  # fmt: skip
    proto = onnx.load(str(outcome.output))
    types = node_types(proto)
    softmax = [n for n in proto.graph.node if n.op_type == "Softmax"]
    assert softmax and all(types[n.output[0]] == TensorProto.FLOAT16 for n in softmax)  # no longer kept
    head = next(n for n in proto.graph.node if "head" in n.name and n.op_type == "MatMul")
    assert types[head.input[1]] == TensorProto.FLOAT and types[head.output[0]] == TensorProto.FLOAT
    assert proto.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT  # made by the kept head
    assert outcome.upcast_reason is None and outcome.comparison.outputs[0].mean_cosine > 0.9999


def test_cast_io(tmp_path):
    source = tmp_path / "mlp.onnx"
    onnx.save(build_mlp(), str(source))
    outcome = cast_model_file(source, tmp_path / "io.onnx", precision="fp16", keep_io=False, data="random")
    proto = onnx.load(str(outcome.output))
    assert [v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]] == [
        TensorProto.FLOAT16
    ] * 2
    assert not any(n.op_type == "Cast" for n in proto.graph.node)
    assert "fp16 inputs (x)" in outcome.upcast_reason and outcome.comparison.outputs[0].mean_cosine > 0.99999


def test_shared_constants_cast_attributes_and_fixed_float_parameters(tmp_path):
    """A constant read by a converted and a kept op is copied; Cast/ConstantOfShape follow; Resize scales stay."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "shift"], ["a"], name="add"),
        helper.make_node("Pow", ["a", "shift"], ["p"], name="pow"),
        helper.make_node("Resize", ["p", "", "scales"], ["up"], name="resize", mode="nearest"),
        helper.make_node("Shape", ["up"], ["shape"], name="shape"),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["ones"],
            name="ones",
            value=numpy_helper.from_array(np.array([1.0], np.float32)),
        ),  # fmt: skip
        helper.make_node("Cast", ["count"], ["count_f"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["ones", "count_f"], ["scaled"], name="mul"),
        helper.make_node("Add", ["up", "scaled"], ["y"], name="out"),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.full((1, 4, 1, 1), 2.0, np.float32), "shift"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        numpy_helper.from_array(np.array(3, np.int64), "count"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 12, 12])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    source = tmp_path / "g.onnx"
    onnx.save(proto, str(source))
    outcome = cast_model_file(source, tmp_path / "g16.onnx", precision="fp16", data="random")
    result = onnx.load(str(outcome.output))
    onnx.checker.check_model(result, full_check=True)
    types = node_types(result)
    stored = {t.name: t.data_type for t in result.graph.initializer}
    assert stored["w"] == TensorProto.FLOAT16 and stored["scales"] == TensorProto.FLOAT
    assert stored["shift"] == TensorProto.FLOAT and stored["shift_fp16"] == TensorProto.FLOAT16  # shared: copied
    by_name = {n.name: n for n in result.graph.node}
    assert list(by_name["add"].input) == ["c", "shift_fp16"] and list(by_name["pow"].input)[1] == "shift"
    assert by_name["to_float"].attribute[0].i == TensorProto.FLOAT16
    assert by_name["ones"].attribute[0].t.data_type == TensorProto.FLOAT16
    assert types["scaled"] == TensorProto.FLOAT16 and types["y"] == TensorProto.FLOAT
    assert outcome.comparison.outputs[0].mean_cosine > 0.9999


def test_models_without_fp32_are_left_alone(tmp_path):
    model = OnnxModel(build_mlp(dtype=np.float16), tmp_path)
    before = model.proto.SerializeToString()
    assert CastPass(precision="fp16")(model).modified is False
    assert model.proto.SerializeToString() == before


def test_recipe_prunes_in_fp32_then_casts(tmp_path):
    path = mlp_with_planted_groups(tmp_path)
    model = OnnxModel.load(path)
    result = load_recipe("tensorrt-2of4-fp16")(model)
    assert [step.name for step in load_recipe("tensorrt-2of4-fp16").passes] == ["fold-constants", "prune", "cast",
                                                                                "verify"]  # fmt: skip
    assert result.modified
    reference = OnnxModel.load(path)
    PrunePass(pattern="2:4", eligible_only=True)(reference)
    pruned, expected = masks_of(model), masks_of(reference)
    assert pruned.keys() == expected.keys() and all(np.array_equal(pruned[k], expected[k]) for k in expected)
    assert {w.dtype for w in find_prunable_weights(model.proto).weights} == {"float16"}


def test_cast_command(encoders, tmp_path, capsys):
    paths, data = encoders
    out = tmp_path / "bf16.onnx"
    assert main(["cast", str(paths[14]), "-o", str(out), "--precision", "bf16", "--data", str(data)]) == 0
    printed = capsys.readouterr().out
    assert "upcast to fp32" in printed and printed.strip().splitlines()[-1].startswith("PASSED | cast to bf16")
    assert "fp32: 2 x Sub (part of a decomposed LayerNorm)" in printed
    assert main(["cast", str(paths[17]), "-o", str(out), "--json", "--no-check"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["precision"] == "fp16" and report["outputs"] is None and report["modified"]
    # The check judges: an impossible floor fails (the model is still written, to look at); no check, no PASSED.
    assert main(["cast", str(paths[17]), "-o", str(out), "--data", str(data), "--min-cosine", "1.0"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAILED | cast to fp16: cosine to fp32 0.9")
    assert out.is_file()
    assert main(["cast", str(paths[17]), "-o", str(out), "--no-check"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("written | cast to fp16, accuracy not checked") and "PASSED" not in last
    assert main(["cast", str(paths[17]), "-o", str(tmp_path / "never.onnx"), "--min-cosine", "1.5"]) == 2
    assert "--min-cosine 1.5: must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "never.onnx").exists()
    assert main(["cast", str(paths[17]), "-o", str(paths[17])]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--in-place" in error
    assert main(["cast", str(paths[17]), "-o", str(out), "--keep-nodes", "("]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "keep_nodes" in error


FLOAT = TensorProto.FLOAT


def test_values_read_from_inside_nested_subgraphs_keep_fp32():
    """'h' is read two scopes down (a Loop body inside an If branch): its producer stays fp32, the rest converts."""
    rng = np.random.default_rng(0)
    value = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["carried", "h"], ["carried_out"]),
        ],
        "body",
        [value("i", TensorProto.INT64, []), value("cond_in", TensorProto.BOOL, []), value("carried", FLOAT, [2, 8])],
        [value("cond_out", TensorProto.BOOL, []), value("carried_out", FLOAT, [2, 8])],
    )
    trip = numpy_helper.from_array(np.array(2, np.int64), "trip")
    then_branch = helper.make_graph(
        [helper.make_node("Loop", ["trip", "", "h"], ["looped"], body=body)],
        "then",
        [],
        [value("looped", FLOAT, [2, 8])],
        initializer=[trip],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["h"], ["negated"])], "else", [], [value("negated", FLOAT, [2, 8])]
    )
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("If", ["cond"], ["picked"], name="branch", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Add", ["picked", "r"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [value("x", FLOAT, [2, 16]), value("cond", TensorProto.BOOL, [])],
        [value("y", FLOAT, [2, 8])],
        [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W")],
    )
    proto = helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", 17)])
    model = OnnxModel(onnx.ModelProto.FromString(proto.SerializeToString()), base_dir=".")
    result = CastPass(precision="fp16")(model)
    rows = {row["name"]: row for row in result.report_json() if row["item"] == "node"}
    assert rows["mm"]["precision"] == "fp32" and "read inside a subgraph" in rows["mm"]["reason"]
    assert rows["branch"]["precision"] == "fp32" and rows["relu"]["precision"] == "fp16"
    onnx.checker.check_model(model.proto, full_check=True)
    for condition in (True, False):
        feeds = {"x": rng.standard_normal((2, 16)).astype(np.float32), "cond": np.array(condition)}
        (expected,) = ort.InferenceSession(proto.SerializeToString()).run(None, feeds)
        (got,) = ort.InferenceSession(model.proto.SerializeToString()).run(None, feeds)
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)


def test_infinite_mask_constants_are_cast_but_nan_weights_are_refused(tmp_path, capsys):
    """Attention masks add -inf on purpose: the weights must be finite, other constants only free of NaN."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Constant", [], ["floor"], value=numpy_helper.from_array(np.array(-np.inf, np.float32))),
        helper.make_node("Max", ["h", "floor"], ["y"]),
    ]
    weight = rng.standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph(
        nodes,
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = tmp_path / "masked.onnx"
    onnx.save(helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", 17)]), model)
    assert main(["cast", str(model), "-o", str(tmp_path / "fp16.onnx")]) == 0
    weight[0, 0] = np.nan
    graph.initializer[0].CopyFrom(numpy_helper.from_array(weight, "W"))
    onnx.save(helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", 17)]), model)
    capsys.readouterr()
    assert main(["cast", str(model), "-o", str(tmp_path / "nan-fp16.onnx")]) == 2
    assert "'W' contains NaN" in capsys.readouterr().err
    assert not (tmp_path / "nan-fp16.onnx").exists()
    # A recipe that only casts runs the same check.
    recipe = tmp_path / "cast-only.toml"
    recipe.write_text('[[passes]]\npass = "cast"\nprecision = "fp16"\n')
    assert main(["run", str(recipe), str(model), "-o", str(tmp_path / "nan-run.onnx")]) == 2
    assert "'W' contains NaN" in capsys.readouterr().err
    assert not (tmp_path / "nan-run.onnx").exists()
