"""The Q/DQ quantization pass on tiny graphs: weight scales on the right axis, 2:4 kept behind DequantizeLinear,
placement (layer inputs, outputs, residual adds, kept ops), the per-layer verdicts, ONNX Runtime runs the result,
and bad inputs refused with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.quantization import LayerQuantization, layer_quantization
from nmdeploy.masks.arrays import nm_compliance
from nmdeploy.masks.pattern import Pattern
from nmdeploy.passes.base import PostconditionError
from nmdeploy.passes.quantize import QuantizedActivation, QuantizedLayer, QuantizePass, RoundedWeight, quantized_io
from nmdeploy.runtimes.onnxruntime import DISABLED_OPTIMIZERS

RNG = np.random.default_rng(0)
RECIPES = Path(__file__).resolve().parent.parent / "passes"


def two_of_four(shape, axis, seed=0):
    """A random weight that is exactly 2:4 along ``axis`` (the two largest of each group kept)."""
    values = np.random.default_rng(seed).normal(0, 0.5, shape).astype(np.float32)
    moved = np.moveaxis(values, axis, -1)
    groups = moved.reshape(-1, 4)
    order = np.argsort(np.abs(groups), axis=1)
    np.put_along_axis(groups, order[:, :2], 0.0, axis=1)
    return np.moveaxis(groups.reshape(moved.shape), -1, axis).copy()


def save(tmp_path, nodes, initializers, inputs, outputs, name="model.onnx", opset=17):
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def calibration(tmp_path, **arrays):
    path = tmp_path / "calib.npz"
    np.savez(path, **arrays)
    return path


def mlp(tmp_path):
    """x -> MatMul W1 [16, 32] -> +b1 -> Relu -> MatMul W2 [32, 8] -> +b2 -> y (both weights 2:4 along K)."""
    rng = np.random.default_rng(11)  # the same model and data whatever ran before
    initializers = {
        "W1": two_of_four((16, 32), 0, 1),
        "b1": rng.normal(0, 0.1, 32).astype(np.float32),
        "W2": two_of_four((32, 8), 0, 2),
        "b2": rng.normal(0, 0.1, 8).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["o"], name="fc2"),
        helper.make_node("Add", ["o", "b2"], ["y"], name="bias2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    path = save(tmp_path, nodes, initializers, [x], [y])
    return path, calibration(tmp_path, x=rng.normal(0, 1, (64, 16)).astype(np.float32)), initializers


def run_model(path, feeds):
    session = ort.InferenceSession(
        str(path), providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_OPTIMIZERS)
    )
    return session.run(None, feeds)[0]


def cosine(a, b):
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    return float(np.mean(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


def layers_of(result):
    return {row.node: row for row in result.report if isinstance(row, QuantizedLayer)}


def dequantizer_of(proto, weight):
    return next(n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == weight)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_mlp_weights_per_channel_on_the_output_axis_2of4_kept_and_ort_runs_it(tmp_path, precision):
    path, calib, initializers = mlp(tmp_path)
    model = OnnxModel.load(path)
    result = QuantizePass(calibration=calib, precision=precision, smooth=False)(model)
    out = model.save(tmp_path / "q.onnx")
    proto = onnx.load(str(out))
    stored = {t.name: t for t in proto.graph.initializer}
    expected_type = TensorProto.INT8 if precision == "int8" else TensorProto.FLOAT8E4M3FN
    for name in ("W1", "W2"):
        assert stored[name].data_type == expected_type
        dq = dequantizer_of(proto, name)
        assert helper.get_attribute_value(dq.attribute[0]) == 1  # MatMul [K, N]: output channels on axis 1
        scale = numpy_helper.to_array(stored[dq.input[1]])
        limit = 127.0 if precision == "int8" else 448.0
        np.testing.assert_allclose(scale, np.abs(initializers[name]).max(axis=0) / limit, rtol=1e-6)
        quantized = numpy_helper.to_array(stored[name]).astype(np.float32)
        # Zeros stay zeros: the pattern is exactly 2:4 along K, and every zero of the float weight is zero.
        assert np.all(quantized[initializers[name] == 0] == 0)
        assert nm_compliance(quantized != 0, Pattern.parse("2:4"), 0).fraction == 1.0
    if precision == "fp8":
        assert next(o.version for o in proto.opset_import if o.domain == "") == 19
    assert main(["inspect", str(out), "--require"]) == 0
    x = RNG.normal(0, 1, (32, 16)).astype(np.float32)
    assert cosine(run_model(path, {"x": x}), run_model(out, {"x": x})) > 0.99
    rows = layers_of(result)
    # fc1's output (through its Relu) is read only by fc2, whose input pair quantizes it: in and out either way.
    assert rows["fc1"].sparse_integer and rows["fc1"].input == rows["fc1"].output == precision
    # The same reading of any Q/DQ model (other tools' output included): fc1 in/out, fc2 float out.
    assert quantized_io(OnnxModel.load(out)) == {"fc1": (True, True), "fc2": (True, False)}
    index = OnnxModel.load(out).index
    layers = {node.name: layer_quantization(index, node) for node in index.main.nodes if node.op_type == "MatMul"}
    assert layers == {
        "fc1": LayerQuantization(precision, precision, precision),
        "fc2": LayerQuantization(precision, precision, None),
    }
    io = "INT8 in/out" if precision == "int8" else "FP8 in"
    assert rows["fc1"].verdict.startswith(f"2:4 + {io}: eligible")
    if precision == "int8":  # fc2 writes the graph output in float: not INT8 out
        assert not rows["fc2"].sparse_integer and "graph output" in rows["fc2"].verdict
    else:  # FP8 in is all sparse FP8 kernels need
        assert rows["fc2"].sparse_integer and rows["fc2"].verdict.startswith("2:4 + FP8 in: eligible")


@pytest.mark.parametrize(
    ("precision", "layer_outputs", "quantized"),
    [("int8", "auto", True), ("fp8", "auto", False), ("fp8", "quantized", True), ("int8", "float", False)],
)
def test_layer_outputs_place_or_leave_the_output_pair(tmp_path, precision, layer_outputs, quantized):
    # The layer's output feeds a residual Add, not another quantized layer: only an output pair of its own quantizes it.
    path, calib = residual_block(tmp_path)
    model = OnnxModel.load(path)
    options = {"layer_outputs": layer_outputs, "smooth": False}
    rows = layers_of(QuantizePass(calibration=calib, precision=precision, **options)(model))
    assert {n.input[0] for n in model.proto.graph.node if n.op_type == "QuantizeLinear"} == (
        {"x", "hb"} if quantized else {"x"}
    )
    out = model.save(tmp_path / "q.onnx")
    assert quantized_io(OnnxModel.load(out)) == {"dense": (True, quantized)}
    dense = rows["dense"]
    assert dense.input == precision and dense.output == (precision if quantized else "float")
    if precision == "fp8":  # FP8 in is what sparse FP8 kernels need, whatever the output
        assert dense.sparse_integer and dense.verdict.startswith("2:4 + FP8 in: eligible")
    elif quantized:
        assert dense.sparse_integer and dense.verdict.startswith("2:4 + INT8 in/out: eligible")
    else:  # INT8 in, float out: TensorRT does not pick sparse INT8 kernels
        assert not dense.sparse_integer and "layer outputs are left in floating point" in dense.verdict
    feeds = {"x": RNG.normal(0, 1, (8, 16)).astype(np.float32)}
    assert cosine(run_model(path, feeds), run_model(out, feeds)) > 0.99


def test_layer_outputs_takes_one_of_three_words(tmp_path):
    path, calib = residual_block(tmp_path)
    with pytest.raises(InputError, match="layer outputs 'int8': choose one of auto, quantized, float"):
        QuantizePass(calibration=calib, layer_outputs="int8")


def test_mlp_placement_one_pair_per_activation(tmp_path):
    path, calib, _ = mlp(tmp_path)
    model = OnnxModel.load(path)
    result = QuantizePass(calibration=calib, precision="int8", method="max", smooth=False)(model)
    assert result.report[-1].method == "max"
    proto = model.proto
    quantized_values = {n.input[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    # fc1's input and fc2's input (the Relu output, which is also fc1's INT8 output); not the graph output.
    assert quantized_values == {"x", "r"}
    readers = {n.name: list(n.input) for n in proto.graph.node}
    assert readers["fc1"][0].endswith("_dequantized") and readers["fc2"][0].endswith("_dequantized")
    assert readers["bias1"][0] == "h"  # the epilogue stays in the GEMM: no pair between MatMul, bias and Relu
    amax = {row.tensor: row.amax for row in result.report if isinstance(row, QuantizedActivation)}
    x = np.load(calib)["x"]
    assert amax["x"] == pytest.approx(np.abs(x).max(), rel=1e-6)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_scale_axis_follows_trans_b(tmp_path, trans_b):
    weight = two_of_four((24, 16), 1, 3) if trans_b else two_of_four((16, 24), 0, 3)
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["g"], name="gemm", transB=trans_b)]
    nodes.append(helper.make_node("Relu", ["g"], ["y"], name="relu"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 24])
    path = save(tmp_path, nodes, {"W": weight, "b": np.zeros(24, np.float32)}, [x], [y])
    calib = calibration(tmp_path, x=RNG.normal(0, 1, (4, 16)).astype(np.float32))
    model = OnnxModel.load(path)
    QuantizePass(calibration=calib, smooth=False)(model)
    dq = dequantizer_of(model.proto, "W")
    axis = helper.get_attribute_value(dq.attribute[0])
    assert axis == (0 if trans_b else 1)  # output channels: rows of [N, K] with transB, columns of [K, N] without
    scale = numpy_helper.to_array(next(t for t in model.proto.graph.initializer if t.name == dq.input[1]))
    np.testing.assert_allclose(scale, np.abs(weight).max(axis=1 - axis) / 127.0, rtol=1e-6)
    out = model.save(tmp_path / "q.onnx")
    feeds = {"x": RNG.normal(0, 1, (4, 16)).astype(np.float32)}
    assert cosine(run_model(path, feeds), run_model(out, feeds)) > 0.99


def test_conv_output_reaches_the_next_conv_through_maxpool(tmp_path):
    initializers = {"W1": two_of_four((16, 8, 3, 3), 1, 4), "W2": two_of_four((8, 16, 1, 1), 1, 5)}
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "W2"], ["y"], name="conv2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 4, 4])
    path = save(tmp_path, nodes, initializers, [x], [y])
    calib = calibration(tmp_path, x=RNG.normal(0, 1, (4, 8, 8, 8)).astype(np.float32))
    model = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib)(model))
    assert helper.get_attribute_value(dequantizer_of(model.proto, "W1").attribute[0]) == 0  # [K, C, R, S]
    assert {n.input[0] for n in model.proto.graph.node if n.op_type == "QuantizeLinear"} == {"x", "p1"}
    assert rows["conv1"].output == "int8" and rows["conv1"].pattern == "2:4"
    assert "small layer" in (rows["conv1"].notes or "")
    out = model.save(tmp_path / "q.onnx")
    assert main(["inspect", str(out), "--require"]) == 0
    feeds = {"x": RNG.normal(0, 1, (2, 8, 8, 8)).astype(np.float32)}
    assert cosine(run_model(path, feeds), run_model(out, feeds)) > 0.99


def residual_block(tmp_path, head="LayerNormalization"):
    """x -> MatMul W -> +b -> Add(., x) -> LayerNorm (or Softmax) -> y."""
    initializers = {
        "W": two_of_four((16, 16), 0, 6),
        "b": np.zeros(16, np.float32),
        "gamma": np.ones(16, np.float32),
        "beta": np.zeros(16, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="dense"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
        helper.make_node("Add", ["hb", "x"], ["s"], name="residual"),
    ]
    if head == "LayerNormalization":
        nodes.append(helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="norm", axis=-1))
    else:
        nodes.append(helper.make_node("Softmax", ["s"], ["y"], name="norm", axis=-1))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])
    path = save(tmp_path, nodes, initializers, [x], [y])
    return path, calibration(tmp_path, x=RNG.normal(0, 1, (32, 16)).astype(np.float32))


def test_residual_add_reads_both_inputs_quantized_and_layer_norm_stays_float(tmp_path):
    path, calib = residual_block(tmp_path)
    model = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib, quantize_residuals=True)(model))
    nodes = {n.name: n for n in model.proto.graph.node}
    assert {n.input[0] for n in nodes.values() if n.op_type == "QuantizeLinear"} == {"x", "hb"}
    assert all(name.endswith("_dequantized") for name in nodes["residual"].input)
    assert nodes["norm"].input[0] == "s"  # no Q/DQ in front of LayerNorm
    assert rows["dense"].output == "int8" and rows["dense"].sparse_integer
    out = model.save(tmp_path / "q.onnx")
    feeds = {"x": RNG.normal(0, 1, (8, 16)).astype(np.float32)}
    assert cosine(run_model(path, feeds), run_model(out, feeds)) > 0.99

    unfused = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib)(unfused))  # the default leaves the residual stream float
    assert [n for n in unfused.proto.graph.node if n.name == "residual"][0].input[1] == "x"
    assert rows["dense"].sparse_integer


def test_output_feeding_a_kept_op_stays_float_with_its_reason(tmp_path):
    initializers = {"W": two_of_four((16, 16), 0, 7)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="scores"),
        helper.make_node("Softmax", ["h"], ["y"], name="softmax", axis=-1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])
    path = save(tmp_path, nodes, initializers, [x], [y])
    calib = calibration(tmp_path, x=RNG.normal(0, 1, (8, 16)).astype(np.float32))
    model = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib)(model))
    assert [n for n in model.proto.graph.node if n.name == "softmax"][0].input[0] == "h"
    assert rows["scores"].output == "float" and not rows["scores"].sparse_integer
    assert "feeds Softmax, kept off Q/DQ" in rows["scores"].verdict
    # Configurable: with Softmax not kept, the output gets its pair and the layer is INT8 in/out.
    model = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib, keep_ops=["LayerNormalization"])(model))
    assert rows["scores"].sparse_integer


def test_verdicts_name_not_2of4_and_tensorrt_shape_rules(tmp_path):
    initializers = {
        "D": RNG.normal(0, 1, (16, 16)).astype(np.float32),  # dense
        "T": two_of_four((16, 12), 0, 8),  # 2:4
        "S": RNG.normal(0, 1, (10, 6)).astype(np.float32),  # K = 10: not a multiple of 4
        "starts": np.array([0], np.int64),
        "ends": np.array([10], np.int64),
        "axes": np.array([1], np.int64),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "D"], ["a"], name="dense_layer"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "T"], ["b"], name="twofour"),
        helper.make_node("Relu", ["b"], ["r2"], name="relu2"),
        helper.make_node("Slice", ["r2", "starts", "ends", "axes"], ["r3"], name="slice"),
        helper.make_node("MatMul", ["r3", "S"], ["y"], name="short_k"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])
    path = save(tmp_path, nodes, initializers, [x], [y])
    calib = calibration(tmp_path, x=RNG.normal(0, 1, (8, 16)).astype(np.float32))
    rows = layers_of(QuantizePass(calibration=calib)(OnnxModel.load(path)))
    assert "not 2:4" in rows["dense_layer"].verdict and rows["dense_layer"].pattern == "dense"
    assert rows["twofour"].sparse_integer  # its Relu output gets a pair of its own (Slice is not data movement)
    assert rows["twofour"].output == "int8"
    assert "TensorRT: reduction axis length 10 is not a multiple of 4" in rows["short_k"].verdict


def test_the_pass_catches_a_pattern_broken_while_quantizing(tmp_path, monkeypatch):
    import nmdeploy.passes.quantize as quantize

    path, calib, _ = mlp(tmp_path)
    model = OnnxModel.load(path)
    insert_pairs = quantize.insert_pairs

    def breaking_insert_pairs(model, *args, **kwargs):  # a bug that fills every pruned position of W1
        weight = next(t for t in model.proto.graph.initializer if t.name == "W1")
        values = numpy_helper.to_array(weight).copy()
        values[values == 0] = 0.1
        model.write(weight, values)
        return insert_pairs(model, *args, **kwargs)

    monkeypatch.setattr(quantize, "insert_pairs", breaking_insert_pairs)
    with pytest.raises(PostconditionError, match=r"broke the 2:4 pattern of \['W1'\]"):
        QuantizePass(calibration=calib)(model)


def test_cli_quantize_prints_verdicts_and_json(tmp_path, capsys):
    path, calib, _ = mlp(tmp_path)
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(path), "-o", str(out), "--calib", str(calib), "--range-method", "mse"]) == 0
    text = capsys.readouterr().out
    assert "2:4 + INT8 in/out: eligible for sparse integer kernels" in text
    assert "written | INT8: 2 of 2 layers quantized, 1 eligible for sparse integer kernels" in text
    out2 = tmp_path / "q2.onnx"
    args = ["quantize", str(path), "-o", str(out2), "--calib", str(calib), "--precision", "fp8", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    layers = [row for row in report if row["item"] == "layer"]
    assert [row["sparse_integer"] for row in layers] == [True, True]  # FP8 in is all sparse FP8 kernels need
    assert "smoothing" not in {row["item"] for row in report}  # FP8: no smoothing unless asked
    # compare runs the FP8 Q/DQ model in ONNX Runtime close to the float model
    assert main(["compare", str(path), str(out2), "--data", str(calib), "--min-fidelity", "0.99"]) == 0


def _refused(capsys, args, tmp_path, out):
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(args) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()
    return error


def test_bad_inputs_refused_in_one_line_with_nothing_written(tmp_path, capsys):
    path, calib, _ = mlp(tmp_path)
    original = path.read_bytes()
    quantized = tmp_path / "q.onnx"
    assert main(["quantize", str(path), "-o", str(quantized), "--calib", str(calib)]) == 0
    capsys.readouterr()
    out = tmp_path / "again.onnx"
    error = _refused(capsys, ["quantize", str(quantized), "-o", str(out), "--calib", str(calib)], tmp_path, out)
    assert "already holds quantization" in error
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((4, 15), np.float32))
    error = _refused(capsys, ["quantize", str(path), "-o", str(out), "--calib", str(wrong)], tmp_path, out)
    assert "input 'x' has shape [4, 15]" in error
    named = tmp_path / "named.npz"
    np.savez(named, tokens=np.zeros((4, 16), np.float32))
    error = _refused(capsys, ["quantize", str(path), "-o", str(out), "--calib", str(named)], tmp_path, out)
    assert "no array for input 'x'" in error
    error = _refused(
        capsys, ["quantize", str(path), "-o", str(out), "--calib", str(calib), "--precision", "int4"], tmp_path, out
    )
    assert error == "nmdeploy quantize: error: unsupported precision 'int4'; choose one of int8, fp8"
    with pytest.raises(InputError, match="unsupported precision 'int4'"):
        QuantizePass(calibration=calib, precision="int4")
    with pytest.raises(InputError, match="entropy"):
        QuantizePass(calibration=calib, precision="fp8", method="entropy")
    assert path.read_bytes() == original


@pytest.mark.parametrize("recipe", ["tensorrt-2of4-int8", "tensorrt-2of4-fp8"])
def test_recipe_prunes_quantizes_and_verifies_behind_dequantize(tmp_path, capsys, recipe):
    path, calib, initializers = mlp(tmp_path)
    dense = OnnxModel.load(path)
    for tensor in dense.proto.graph.initializer:
        if tensor.name in ("W1", "W2"):
            dense.write(tensor, RNG.normal(0, 0.5, tuple(tensor.dims)).astype(np.float32))
    dense_path = dense.save(tmp_path / "dense.onnx")
    out = tmp_path / "q.onnx"
    recipe = str(RECIPES / f"{recipe}.toml")  # by path: the installed package may map its recipes elsewhere
    assert main(["run", recipe, str(dense_path), "-o", str(out), "--calib", str(calib)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED")
    stored = {t.name: t.data_type for t in onnx.load(str(out)).graph.initializer}
    assert stored["W1"] == (TensorProto.INT8 if recipe.endswith("int8.toml") else TensorProto.FLOAT8E4M3FN)
    assert main(["inspect", str(out), "--require"]) == 0
    capsys.readouterr()
    missing = tmp_path / "none.onnx"
    assert main(["run", recipe, str(dense_path), "-o", str(missing)]) == 2
    assert "needs calibration data: pass --calib DATA" in capsys.readouterr().err
    assert not missing.exists()


def test_activation_statistics_come_from_the_engine_on_the_fit_rows_only(tmp_path):
    from nmdeploy.calibration.activation_statistics import activation_histograms
    from nmdeploy.calibration.data import CalibrationData, SplitSettings

    path, calib, initializers = mlp(tmp_path)
    model = OnnxModel.load(path)
    split = CalibrationData(calib, model.proto).split(SplitSettings(rows=8, held_out=0.25, seed=0))
    histograms, samples = activation_histograms(model, ["x", "r"], split)
    fit = np.concatenate([batch["x"] for batch in split.train])
    assert samples == len(fit) == 48  # the held-out quarter is never seen
    assert histograms["x"].max_abs == pytest.approx(float(np.abs(fit).max()))
    relu = np.maximum(fit @ initializers["W1"] + initializers["b1"], 0)
    assert histograms["r"].max_abs == pytest.approx(float(relu.max()), rel=1e-5)
    assert histograms["r"].total == relu.size


def test_fp16_model_after_cast_gets_fp16_scales_at_opset_19(tmp_path):
    from nmdeploy.passes.cast import CastPass

    path, calib, _ = mlp(tmp_path)
    half = OnnxModel.load(path)
    CastPass(precision="fp16")(half)
    half_path = half.save(tmp_path / "half.onnx")
    model = OnnxModel.load(half_path)
    result = QuantizePass(calibration=calib, method="max")(model)
    assert [(row.before, row.after) for row in result.report if row.item == "opset"] == [(17, 19)]
    stored = {t.name: t for t in model.proto.graph.initializer}
    assert stored[dequantizer_of(model.proto, "W1").input[1]].data_type == TensorProto.FLOAT16
    out = model.save(tmp_path / "q.onnx")
    x = RNG.normal(0, 1, (16, 16)).astype(np.float32)
    assert cosine(run_model(path, {"x": x}), run_model(out, {"x": x})) > 0.99


def test_smoothing_moves_an_outlier_channel_into_the_weights_and_keeps_2of4(tmp_path):
    path, _, initializers = mlp(tmp_path)
    x = RNG.normal(0, 1, (256, 16)).astype(np.float32)
    x[:, 3] *= 60.0  # one outlier channel, as transformer activations have
    calib = calibration(tmp_path, x=x)
    feeds = {"x": x[:64]}
    fidelity = {}
    for smooth in (False, True):
        model = OnnxModel.load(path)
        result = QuantizePass(calibration=calib, method="max", smooth=smooth, smoothing_strength=1.0)(model)
        out = model.save(tmp_path / f"q-{smooth}.onnx")
        fidelity[smooth] = cosine(run_model(path, feeds), run_model(out, feeds))
        assert main(["inspect", str(out), "--require"]) == 0
    smoothed = [row for row in result.report if row.item == "smoothing"]
    assert [row.tensor for row in smoothed] == ["x", "r"] and smoothed[0].layers == ["fc1"]
    mul = next(n for n in model.proto.graph.node if n.op_type == "Mul")
    factors = 1.0 / numpy_helper.to_array(next(t for t in model.proto.graph.initializer if t.name == mul.input[1]))
    expected = np.abs(x).max(axis=0)  # strength 1: s = max |x| per channel
    np.testing.assert_allclose(factors, expected, rtol=1e-5)
    quantize_input = next(n for n in model.proto.graph.node if n.op_type == "QuantizeLinear")
    assert quantize_input.input[0] == mul.output[0]
    assert fidelity[True] > fidelity[False] + 0.002
    default = QuantizePass(calibration=calib)(OnnxModel.load(path)).report  # INT8 smooths by default
    assert [row.strength for row in default if row.item == "smoothing"] == [0.85, 0.85]


def test_opset_below_13_is_raised_for_per_channel_int8(tmp_path):
    initializers = {"W": two_of_four((16, 8), 0, 10)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"), helper.make_node("Relu", ["h"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    path = save(tmp_path, nodes, initializers, [x], [y], opset=11)
    calib = calibration(tmp_path, x=RNG.normal(0, 1, (32, 16)).astype(np.float32))
    model = OnnxModel.load(path)
    result = QuantizePass(calibration=calib, method="max")(model)
    assert [(row.before, row.after) for row in result.report if row.item == "opset"] == [(11, 13)]
    out = model.save(tmp_path / "q.onnx")
    feeds = {"x": RNG.normal(0, 1, (8, 16)).astype(np.float32)}
    assert cosine(run_model(path, feeds), run_model(out, feeds)) > 0.99


def test_a_model_without_weighted_layers_is_nothing_to_quantize(tmp_path, capsys):
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    path = save(tmp_path, nodes, {}, [x], [y])
    out = tmp_path / "q.onnx"
    error = _refused(capsys, ["quantize", str(path), "-o", str(out), "--calib", "random"], tmp_path, out)
    assert "nothing to quantize" in error


def test_chosen_layers_alone_are_quantized_and_the_others_say_why(tmp_path):
    path, calib, _ = mlp(tmp_path)
    model = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib, layers=["W2"], smooth=False)(model))
    assert rows["fc1"].weight_precision == "float" and "not among the layers chosen" in rows["fc1"].verdict
    assert rows["fc2"].weight_precision == "int8"
    stored = {t.name: t.data_type for t in model.proto.graph.initializer}
    assert stored["W1"] == TensorProto.FLOAT and stored["W2"] == TensorProto.INT8
    assert {n.input[0] for n in model.proto.graph.node if n.op_type == "QuantizeLinear"} == {"r"}
    by_node = layers_of(QuantizePass(calibration=calib, layers=["fc1"], smooth=False)(OnnxModel.load(path)))
    assert by_node["fc1"].weight_precision == "int8" and by_node["fc2"].weight_precision == "float"
    # fc1 alone keeps INT8 out (fc2 reads the pair in floating point), as TensorRT's sparse INT8 kernels need.
    assert by_node["fc1"].sparse_integer


def test_a_float_output_is_kept_with_the_reason_given(tmp_path):
    path, calib = residual_block(tmp_path)
    model = OnnxModel.load(path)
    reason = "its output feeds the residual stream, measured sensitive"
    rows = layers_of(QuantizePass(calibration=calib, float_outputs={"W": reason}, smooth=False)(model))
    assert {n.input[0] for n in model.proto.graph.node if n.op_type == "QuantizeLinear"} == {"x"}
    assert rows["dense"].output == "float" and not rows["dense"].sparse_integer
    assert reason in rows["dense"].verdict
    assert layers_of(QuantizePass(calibration=calib)(OnnxModel.load(path)))["dense"].output == "int8"


def test_first_layer_on_few_channel_raw_input_stays_float_unless_asked(tmp_path):
    initializers = {"W1": RNG.normal(0, 0.5, (8, 1, 3, 3)).astype(np.float32), "W2": two_of_four((8, 8, 1, 1), 1, 9)}
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2"], ["y"], name="conv2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 8, 8])
    path = save(tmp_path, nodes, initializers, [x], [y])
    calib = calibration(tmp_path, x=RNG.uniform(0, 1, (4, 1, 8, 8)).astype(np.float32))
    for precision in ("int8", "fp8"):
        rows = layers_of(QuantizePass(calibration=calib, precision=precision)(OnnxModel.load(path)))
        assert rows["conv1"].weight_precision == "float"
        assert "reads the model's input directly with 1 channel(s)" in rows["conv1"].verdict
        assert rows["conv2"].weight_precision == precision
    model = OnnxModel.load(path)
    rows = layers_of(QuantizePass(calibration=calib, quantize_raw_input=True)(model))
    assert rows["conv1"].weight_precision == "int8" and "x" in {
        n.input[0] for n in model.proto.graph.node if n.op_type == "QuantizeLinear"
    }


def test_an_output_with_an_outlier_channel_is_rescaled_per_channel_or_kept_float(tmp_path):
    path, _ = residual_block(tmp_path)
    model = OnnxModel.load(path)
    weight = next(t for t in model.proto.graph.initializer if t.name == "W")
    values = numpy_helper.to_array(weight).copy()
    values[:, 0] *= 400.0  # one output channel far above the others: the energy sits in it
    model.write(weight, values)
    outlier = model.save(tmp_path / "outlier.onnx")
    x = RNG.normal(0, 1, (256, 16)).astype(np.float32)
    calib = calibration(tmp_path, x=x)
    feeds = {"x": x[:64]}
    reference = run_model(outlier, feeds)

    # Default: the channel is divided out of the weight's column and bias, multiplied back after the DequantizeLinear.
    rescaled = OnnxModel.load(outlier)
    result = QuantizePass(calibration=calib, smooth=False)(rescaled)
    assert layers_of(result)["dense"].output == "int8" and layers_of(result)["dense"].sparse_integer
    (row,) = [r for r in result.report if r.item == "rescaled output"]
    assert row.tensor == "hb" and row.channels == 1 and row.largest_factor > 50
    assert row.lost_before > 0.05 > row.lost_after
    mul = next(n for n in rescaled.proto.graph.node if n.op_type == "Mul")
    assert rescaled.index.main.producer(mul.input[0]).op_type == "DequantizeLinear"
    assert [n for n in rescaled.proto.graph.node if n.name == "residual"][0].input[0] == mul.output[0]
    assert main(["inspect", str(rescaled.save(tmp_path / "rescaled.onnx")), "--require"]) == 0

    # Without rescaling the output stays float, with the measured share as its reason.
    kept = OnnxModel.load(outlier)
    rows = layers_of(QuantizePass(calibration=calib, smooth=False, rescale_outputs=False)(kept))
    assert rows["dense"].output == "float" and "of its energy to a per-tensor INT8 range" in rows["dense"].verdict
    assert {n.input[0] for n in kept.proto.graph.node if n.op_type == "QuantizeLinear"} == {"x"}

    forced = OnnxModel.load(outlier)
    rows = layers_of(QuantizePass(calibration=calib, smooth=False, output_error_limit=None)(forced))
    assert rows["dense"].output == "int8"
    fidelity = {
        name: cosine(reference, run_model(candidate.save(tmp_path / f"{name}.onnx"), feeds))
        for name, candidate in (("rescaled", rescaled), ("kept", kept), ("forced", forced))
    }
    assert fidelity["rescaled"] > fidelity["forced"] and fidelity["kept"] > fidelity["forced"]
    with pytest.raises(InputError, match="output error limit"):
        QuantizePass(calibration=calib, output_error_limit=0.0)


def test_auto_method_judges_gemm_inputs_by_their_layer_and_the_rest_by_the_default(tmp_path):
    path, calib = residual_block(tmp_path)
    model = OnnxModel.load(path)
    result = QuantizePass(calibration=calib, method="auto", smooth=False, output_error_limit=None)(model)
    methods = {row.tensor: row.method for row in result.report if isinstance(row, QuantizedActivation)}
    assert methods["x"].split(": ")[1] in ("max", "percentile", "mse", "entropy") and methods["x"] != "auto: "
    assert methods["hb"] == "auto: entropy"  # the layer's output reaches no GEMM: INT8's default
    out = model.save(tmp_path / "q.onnx")
    feeds = {"x": RNG.normal(0, 1, (8, 16)).astype(np.float32)}
    assert cosine(run_model(path, feeds), run_model(out, feeds)) > 0.99


def test_more_bad_inputs_one_line_exit_2_nothing_written(tmp_path, capsys):
    path, calib, initializers = mlp(tmp_path)
    out = tmp_path / "q.onnx"
    # Calibration data that do not match the inputs: another dtype, NaN values.
    doubles = calibration(tmp_path, x=np.zeros((8, 16), np.float64))
    error = _refused(capsys, ["quantize", str(path), "-o", str(out), "--calib", str(doubles)], tmp_path, out)
    assert "input 'x' is float64" in error
    broken = tmp_path / "nan.npz"
    np.savez(broken, x=np.full((8, 16), np.nan, np.float32))
    error = _refused(capsys, ["quantize", str(path), "-o", str(out), "--calib", str(broken)], tmp_path, out)
    assert "NaN or infinite" in error
    # Q/DQ already present on a weight alone (weight-only quantization by another tool).
    nodes = [
        helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"], name="dq", axis=1),
        helper.make_node("MatMul", ["x", "W"], ["y"], name="fc"),
    ]
    stored = {
        "Wq": np.zeros((16, 8), np.int8),
        "s": np.ones(8, np.float32),
        "z": np.zeros(8, np.int8),
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    weight_only = save(tmp_path, nodes, stored, [x], [y], name="weight-only.onnx")
    error = _refused(capsys, ["quantize", str(weight_only), "-o", str(out), "--calib", str(calib)], tmp_path, out)
    assert "already holds quantization (DequantizeLinear 'dq')" in error
    for precision in ("fp16", "INT4"):
        args = ["quantize", str(path), "-o", str(out), "--calib", str(calib), "--precision", precision]
        assert f"unsupported precision '{precision}'" in _refused(capsys, args, tmp_path, out)
    args = ["quantize", str(path), "-o", str(out), "--calib", str(calib), "--range-method", "minmax"]
    assert "unknown range method 'minmax'" in _refused(capsys, args, tmp_path, out)
    for flag, value, reason in (
        ("--layer-outputs", "int8", "layer outputs 'int8': choose one of auto, quantized, float"),
        ("--weight-rounding", "exact", "weight rounding 'exact': choose one of gptq, nearest"),
    ):
        args = ["quantize", str(path), "-o", str(out), "--calib", str(calib), flag, value]
        assert reason in _refused(capsys, args, tmp_path, out)


def test_unknown_layer_names_are_refused(tmp_path):
    path, calib, _ = mlp(tmp_path)
    with pytest.raises(InputError, match="no Conv, Gemm or MatMul layer or weight named 'W9'"):
        QuantizePass(calibration=calib, layers=["W1", "W9"])(OnnxModel.load(path))
    with pytest.raises(InputError, match="named 'fc9'"):
        QuantizePass(calibration=calib, float_outputs={"fc9": "why"})(OnnxModel.load(path))


def test_a_rescaled_output_kept_float_after_all_computes_what_the_float_model_did(tmp_path):
    """An output rescaled per channel that still loses more than the limit is kept float: its weight column and
    bias must be restored, since no DequantizeLinear (and no Mul after it) is left to multiply the channel back."""
    path, _ = residual_block(tmp_path)
    model = OnnxModel.load(path)
    weight = next(t for t in model.proto.graph.initializer if t.name == "W")
    values = numpy_helper.to_array(weight).copy()
    values[:, 0] *= 400.0  # an outlier channel: rescaled
    model.write(weight, values)
    outlier = model.save(tmp_path / "outlier.onnx")
    rng = np.random.default_rng(1)
    smooth_data = rng.normal(0, 1, (256, 16)).astype(np.float32)
    spiky = rng.normal(0, 1, (256, 16)).astype(np.float32)
    spiky[rng.random(spiky.shape) < 0.005] *= 300.0  # rare spikes in every channel: 14-31 % lost once rescaled

    def quantized(x, **options):
        calib = calibration(tmp_path, x=x)
        kept = OnnxModel.load(outlier)
        result = QuantizePass(calibration=calib, smooth=False, **options)(kept)
        never = OnnxModel.load(outlier)  # the same layer kept float without rescaling first
        QuantizePass(calibration=calib, smooth=False, rescale_outputs=False, **options)(never)
        feeds = {"x": x[:64]}
        outputs = [run_model(m.save(tmp_path / f"{n}.onnx"), feeds) for n, m in (("kept", kept), ("never", never))]
        return result, kept, *outputs

    # Any rescaled output above a small limit (it loses 0.02 % rescaled): the float model's output, not 0.39 cosine.
    small_limit = quantized(smooth_data, output_error_limit=1e-6)
    assert cosine(run_model(outlier, {"x": smooth_data[:64]}), small_limit[2]) > 0.99
    # The default limit on spiky data: what the layer kept float without rescaling computes.
    default_limit = quantized(spiky)
    _, _, got, expected = default_limit
    assert np.allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    for result, kept, _, _ in (small_limit, default_limit):
        row = layers_of(result)["dense"]
        assert row.output == "float" and not row.sparse_integer
        assert "with its outlier channels rescaled" in row.verdict and " 0% " not in row.verdict
        assert not [r for r in result.report if r.item == "rescaled output"]  # undone, so not reported
        assert not [n for n in kept.proto.graph.node if n.op_type == "Mul"]
        bias = next(t for t in kept.proto.graph.initializer if t.name == "b")
        assert np.array_equal(numpy_helper.to_array(bias), np.zeros(16, np.float32))


def test_a_densified_fp8_weight_fails_inspect_require_and_the_quantize_self_check(tmp_path):
    """FP8 stored values below 1 are real non-zeros: an integer cast would truncate them to 0 and call a dense
    weight 2:4."""
    import ml_dtypes

    from nmdeploy.graph.inspection import inspect_model
    from nmdeploy.passes.quantize import _check_pattern_kept

    path, calib, _ = mlp(tmp_path)
    model = OnnxModel.load(path)
    QuantizePass(calibration=calib, precision="fp8", smooth=False)(model)
    out = model.save(tmp_path / "q.onnx")
    assert main(["inspect", str(out), "--require"]) == 0
    proto = onnx.load(str(out))
    stored = next(t for t in proto.graph.initializer if t.name == "W1")
    values = numpy_helper.to_array(stored).astype(np.float32)
    assert (values == 0).mean() == 0.5
    densified = np.where(values == 0, np.float32(0.25), values).astype(ml_dtypes.float8_e4m3fn)
    stored.CopyFrom(numpy_helper.from_array(densified, "W1"))
    assert stored.data_type == TensorProto.FLOAT8E4M3FN
    dense_path = tmp_path / "dense.onnx"
    onnx.save(proto, str(dense_path))
    assert main(["inspect", str(dense_path), "--require"]) != 0
    rows = {row.weight: row for row in inspect_model(OnnxModel.load(dense_path), "2:4").rows}
    assert rows["W1"].compliant < 1.0 and rows["W2"].compliant == 1.0
    with pytest.raises(PostconditionError, match="W1"):
        _check_pattern_kept(rows, {"W1", "W2"})


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_model_with_external_data_quantizes_from_any_working_folder(tmp_path, monkeypatch, precision):
    path, calib, _ = mlp(tmp_path)
    folder = tmp_path / "external"
    folder.mkdir()
    external = folder / "model.onnx"
    onnx.save(onnx.load(str(path)), str(external), save_as_external_data=True, size_threshold=0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the checker alone would look the data file up here
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(external), "-o", str(out), "--calib", str(calib), "--precision", precision]) == 0
    x = RNG.normal(0, 1, (8, 16)).astype(np.float32)
    assert cosine(run_model(path, {"x": x}), run_model(out, {"x": x})) > 0.99
    assert list(elsewhere.iterdir()) == []


def test_the_structure_check_sees_nodes_not_stored_bytes(tmp_path):
    from nmdeploy.graph.model_checks import check_structure

    path, _, _ = mlp(tmp_path)
    onnx.save(onnx.load(str(path)), str(tmp_path / "ext.onnx"), save_as_external_data=True, size_threshold=0)
    proto = onnx.load(str(tmp_path / "ext.onnx"), load_external_data=False)
    check_structure(proto)  # the data file is not in the working folder, and is not looked up
    broken = onnx.ModelProto()
    broken.CopyFrom(proto)
    broken.graph.node[3].input[0] = "undefined"
    with pytest.raises(onnx.checker.ValidationError, match="undefined"):
        check_structure(broken)
    broken.CopyFrom(proto)
    broken.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(onnx.checker.ValidationError, match="NoSuchOp"):
        check_structure(broken)


def test_the_structure_check_reads_no_stored_bytes_inside_subgraphs(tmp_path, monkeypatch):
    from onnx import TensorProto, helper, numpy_helper

    from nmdeploy.graph.model_checks import check_structure

    weight = numpy_helper.from_array(RNG.normal(0, 1, (64, 4)).astype(np.float32), "branch_weight")
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", "branch_weight"], ["then_y"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, [2, 4])],
        [weight],
    )
    else_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", "other_weight"], ["else_y"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.zeros((64, 4), np.float32), "other_weight")],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        "branchy",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    folder = tmp_path / "model"
    folder.mkdir()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(folder / "m.onnx"), save_as_external_data=True, size_threshold=0, location="m.data")
    proto = onnx.load(str(folder / "m.onnx"), load_external_data=False)
    branches = {attribute.name: attribute.g for attribute in proto.graph.node[0].attribute}
    stored = branches["then_branch"].initializer[0]
    assert stored.name == "branch_weight" and stored.data_location == TensorProto.EXTERNAL
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the checker given the model itself would look m.data up here and fail
    check_structure(proto)
    assert list(elsewhere.iterdir()) == []
    for branch, name in (("then_branch", "not_in_scope"), ("else_branch", "branch_weight")):
        broken = onnx.ModelProto()
        broken.CopyFrom(proto)
        graph = next(attribute.g for attribute in broken.graph.node[0].attribute if attribute.name == branch)
        graph.node[0].input[1] = name  # undefined, or the other branch's weight, which is out of this one's scope
        with pytest.raises(onnx.checker.ValidationError, match=name):
            check_structure(broken)


def correlated_layer(tmp_path, shared=False):
    """x [batch, 64] with correlated channels (8 latent factors, as real activations have) -> MatMul W [64, 32], 2:4
    along K -> y; with ``shared`` a second MatMul reads W too."""
    rng = np.random.default_rng(5)
    latent = rng.normal(0, 1, (512, 8)).astype(np.float32)
    x = latent @ rng.normal(0, 1, (8, 64)).astype(np.float32) + 0.05 * rng.normal(0, 1, (512, 64)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="dense")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])]
    if shared:
        nodes.append(helper.make_node("MatMul", ["x2", "W"], ["z"], name="again"))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 32]))
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 64]) for name in ("x", "x2")[: 1 + shared]
    ]
    path = save(tmp_path, nodes, {"W": two_of_four((64, 32), 0, 9)}, inputs, outputs)
    feeds = {"x": x, **({"x2": x[::-1].copy()} if shared else {})}
    return path, calibration(tmp_path, **feeds), feeds


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_gptq_rounding_stores_its_grid_keeps_2of4_and_cuts_the_layer_error(tmp_path, precision):
    path, calib, feeds = correlated_layer(tmp_path)
    weight = numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])
    errors = {}
    for rounding in ("nearest", "gptq"):
        model = OnnxModel.load(path)
        result = QuantizePass(calibration=calib, precision=precision, smooth=False, weight_rounding=rounding)(model)
        out = model.save(tmp_path / f"{rounding}.onnx")
        (row,) = [r for r in result.report if isinstance(r, RoundedWeight)] or [None]
        proto = onnx.load(str(out))
        stored = {t.name: t for t in proto.graph.initializer}
        # The float weight's per-channel scales either way: GPTQ picks other grid points, not another grid.
        scale = numpy_helper.to_array(stored[dequantizer_of(proto, "W").input[1]])
        np.testing.assert_allclose(scale, np.abs(weight).max(axis=0) / (127.0 if precision == "int8" else 448.0))
        quantized = numpy_helper.to_array(stored["W"]).astype(np.float32)
        assert np.all(quantized[weight == 0] == 0) and main(["inspect", str(out), "--require"]) == 0
        # The Q/DQ arithmetic as written (int32 sums, as TensorRT's kernels): ONNX Runtime's fused u8 x s8 kernels
        # on CPUs without VNNI (AVX2) saturate 16-bit pair sums, 10x this error, more for GPTQ's grid points.
        unfused = ort.SessionOptions()
        unfused.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        candidate = ort.InferenceSession(str(out), unfused, providers=["CPUExecutionProvider"]).run(
            None, {"x": feeds["x"]}
        )[0]
        reference = run_model(path, {"x": feeds["x"]})
        errors[rounding] = float(np.sum((reference - candidate) ** 2) / np.sum(reference**2))
        if rounding == "nearest":
            assert row is None
        else:
            # The layer's output error from its weights alone, on the statistics: 0.37x (int8), 0.31x (fp8).
            assert row.rounding == "gptq" and row.error_rounded < 0.5 * row.error_nearest
    # The activations' rounding (the same ranges in both models) comes on top; GPTQ's weights still leave less.
    assert errors["gptq"] < errors["nearest"], errors


def test_a_weight_two_layers_read_is_rounded_to_nearest_with_its_reason(tmp_path):
    path, calib, _ = correlated_layer(tmp_path, shared=True)
    result = QuantizePass(calibration=calib, smooth=False)(OnnxModel.load(path))
    (row,) = [r for r in result.report if isinstance(r, RoundedWeight)]
    assert (row.weight, row.rounding) == ("W", "nearest") and "several layers read it" in row.reason
    with pytest.raises(InputError, match="weight rounding 'exact': choose one of gptq, nearest"):
        QuantizePass(calibration=calib, weight_rounding="exact")
