"""The TensorRT sparsity report without TensorRT: builder log and engine inspector parsing on fixtures, the join with
nmdeploy's prediction, shape specs, and ``nmdeploy build``'s message where TensorRT is missing.

The fixtures in tests/fixtures/tensorrt are written by hand, not captured from a TensorRT run (no GPU here). They keep
to the formats TensorRT documents: the builder's two "(Sparsity)" lines ("Layers eligible for sparse math: A, B" and
"TRT inference plan picked sparse implementation for layers: A"), as the developer guide's structured-sparsity section
and NVIDIA's TensorRT 8 sparsity article print them, behind trtexec's "[date] [I] [TRT]" prefix or the TensorRT 8
Python logger's "[TensorRT] INFO:"; and the engine inspector's JSON ("Layers" with "Bindings": layer names only, or
objects with Name, LayerType, Inputs, Outputs and TacticValue at detailed verbosity). Other log lines are context the
parser must skip. A real capture belongs in the GPU checks, not here.

Each inspector fixture exists for both schemas: ``*-layers.json`` as TensorRT 10 writes it (``Bindings``, one
``Format/Datatype`` string per tensor, as in the 10.x developer guide's inspector example) and
``*-layers-tensorrt11.json``, the same engine as TensorRT 11 writes it after the schema change its IEngineInspector
migration guide documents: ``I/O Tensors`` objects (``Name``, ``IOMode``, ``DataType``, ``Dimensions``, ``Location``,
``IsShapeInferenceIO``, ``ProfileInfo`` with ``Format``) in place of ``Bindings``, and ``Format`` ("... format
(kLINEAR)") split from ``DataType`` ("Float", "Half", "Int8") on every layer tensor."""

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import PrunePass
from nmdeploy.passes.cast import CastPass
from nmdeploy.runtimes.engine_report import (
    DENSE_CHOSEN,
    MISSED,
    NOT_ELIGIBLE,
    SPARSE,
    UNKNOWN,
    EngineReport,
    LayerRow,
    SparsityLog,
    fp32_sparse_warning,
    graph_precisions,
    join_report,
    onnx_nodes_of,
    parse_builder_log,
    quantized_types,
    split_top_level,
)
from nmdeploy.runtimes.inspector import EngineTensor, format_precision, parse_io_tensors, parse_layer_information
from nmdeploy.runtimes.shapes import parse_shapes, shape_ranges

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "tensorrt"
# The inspector fixtures of one engine in each TensorRT's schema.
SCHEMAS = pytest.mark.parametrize("suffix", ["", "-tensorrt11"], ids=["tensorrt10", "tensorrt11"])


def inspector_fixture(name: str, suffix: str) -> str:
    return (FIXTURES / f"{name}{suffix}.json").read_text()


def sparse_mlp(path, width=512, precision="fp16", batch=8):
    """fc1, fc2 (width x width) and fc3 (64 x width) pruned to 2:4 and cast; the head MatMul stays dense."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gemm", ["x", "fc1.weight"], ["h1"], transB=1, name="/fc1/Gemm"),
        helper.make_node("Relu", ["h1"], ["r1"], name="/act/Relu"),
        helper.make_node("Gemm", ["r1", "fc2.weight"], ["h2"], transB=1, name="/fc2/Gemm"),
        helper.make_node("Relu", ["h2"], ["r2"], name="/act2/Relu"),
        helper.make_node("Gemm", ["r2", "fc3.weight"], ["h3"], transB=1, name="/fc3/Gemm"),
        helper.make_node("MatMul", ["h3", "head.weight"], ["y"], name="/head/MatMul"),
    ]
    weights = {"fc1.weight": (width, width), "fc2.weight": (width, width), "fc3.weight": (64, width)}
    weights["head.weight"] = (64, 16)
    inits = [
        numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), name)
        for name, shape in weights.items()
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 16])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    proto.producer_name = "nmdeploy-tests"
    onnx.save(proto, str(path))
    model = OnnxModel.load(path)
    PrunePass(pattern="2:4", exclude="head")(model)
    if precision != "fp32":
        CastPass(precision=precision)(model)
    model.save(path)
    return path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    path = sparse_mlp(tmp_path_factory.mktemp("mlp") / "mlp-2of4-fp16.onnx")
    model = OnnxModel.load(path)
    return inspect_model(model), [node.name for node in model.proto.graph.node]


def test_builder_log_lines_of_trtexec_and_tensorrt_8():
    log = parse_builder_log((FIXTURES / "mlp-trtexec.log").read_text())
    assert log.eligible == ("/fc1/Gemm + /act/Relu", "/fc2/Gemm + /act2/Relu")
    assert log.picked == ("/fc1/Gemm + /act/Relu",)
    old = parse_builder_log((FIXTURES / "resnet-tensorrt8.log").read_text().splitlines())
    assert old.eligible == ("Conv_0 + Relu_1", "Conv_2 + Add_3 + Relu_4", "Gemm_9")
    assert old.picked == ()  # the line is there and empty: nothing picked, which is not the same as no line
    assert parse_builder_log("[I] [TRT] Engine generation completed") == SparsityLog(None, None)


def test_layer_names_map_back_to_onnx_nodes():
    order = ["/a/Mul", "/a/Add", "/a/Erf", "/fc/MatMul", "/l/MatMul", "/l/Softmax", "/l/LayerNorm", "/out/Gemm"]
    assert split_top_level("PWN(x, y), {ForeignNode[a...b]}, c", ",") == ["PWN(x, y)", "{ForeignNode[a...b]}", "c"]
    assert onnx_nodes_of("/fc/MatMul + PWN(PWN(/a/Mul, /a/Add), /a/Erf)", order) == (
        "/fc/MatMul",
        "/a/Mul",
        "/a/Add",
        "/a/Erf",
    )
    assert onnx_nodes_of("{ForeignNode[/l/MatMul.../l/LayerNorm]}", order) == (
        "/l/MatMul",
        "/l/Softmax",
        "/l/LayerNorm",
    )
    assert onnx_nodes_of("(Unnamed Layer* 5) [Shuffle]", order) == ()
    # A node whose name itself contains " + " is matched whole before any splitting.
    assert onnx_nodes_of("a + b", ["a + b", "a", "b"]) == ("a + b",)


def test_inspector_json_detailed_and_names_only():
    layers = parse_layer_information((FIXTURES / "mlp-layers.json").read_text())
    assert [layer.name for layer in layers][1:5] == ["/fc1/Gemm + /act/Relu", "/fc2/Gemm + /act2/Relu", "/fc3/Gemm",
                                                     "/head/MatMul"]  # fmt: skip
    fc1, fc2, fc3 = layers[1:4]
    assert fc1.onnx_nodes == ("/fc1/Gemm", "/act/Relu") and fc1.has_sparse_weights and fc1.sparse_tactic
    assert fc2.has_sparse_weights and fc2.sparse_tactic is False
    assert fc3.has_sparse_weights is False and layers[0].onnx_nodes == ()
    names_only = parse_layer_information((FIXTURES / "mlp-layers-names-only.json").read_text())
    assert names_only[0].name == "/fc1/Gemm + /act/Relu" and names_only[0].sparse_tactic is None
    with pytest.raises(InputError, match="no 'Layers' list"):
        parse_layer_information('{"Bindings": []}')
    with pytest.raises(InputError, match="not JSON"):
        parse_layer_information("Layers: none")


def test_both_inspector_schemas_give_the_same_layers_and_io():
    for name in ("mlp-layers", "mlp-int8-layers"):
        ten, eleven = (inspector_fixture(name, suffix) for suffix in ("", "-tensorrt11"))
        assert "Bindings" in ten and "Format/Datatype" in ten and "Format/Datatype" not in eleven
        layers = parse_layer_information(eleven)
        assert layers == parse_layer_information(ten)
        assert {(layer.input_precision, layer.output_precision) for layer in layers if layer.layer_type} >= {
            ("fp16", "fp16") if name == "mlp-layers" else ("int8", "int8")
        }
        assert parse_io_tensors(ten) == (EngineTensor("x"), EngineTensor("y"))  # TensorRT 10: names only
        assert parse_io_tensors(eleven) == (
            EngineTensor("x", "input", "fp32", (8, 512)),
            EngineTensor("y", "output", "fp32", (8, 16)),
        )
    assert parse_io_tensors((FIXTURES / "mlp-layers-names-only.json").read_text())[0] == EngineTensor("x")
    assert parse_io_tensors('{"Layers": []}') == ()
    with pytest.raises(InputError, match="an 'I/O Tensors' entry is not an object"):
        parse_io_tensors('{"Layers": [], "I/O Tensors": ["x"]}')


def test_tensorrt_11_types_come_from_datatype_not_the_format_words():
    def layer(inputs, outputs):
        return {"Name": "fc", "LayerType": "CaskGemmMatrixMultiply", "Inputs": inputs, "Outputs": outputs}

    linear = "Row major linear format (kLINEAR)"  # a layout that names no type
    document = {
        "Layers": [
            layer([{"Format": linear, "DataType": "Int8"}], [{"Format": linear, "DataType": "BFloat16"}]),
            layer([{"Format": "Row major linear FP32 format (kLINEAR)", "DataType": "Int32"}], [{"DataType": "FP8"}]),
            layer([{"Format": linear}], [{"Format/Datatype": "Row major linear FP16 format"}]),
        ]
    }
    precisions = [(item.input_precision, item.output_precision) for item in parse_layer_information(document)]
    # DataType decides where present (Int32 has no precision here, whatever the format says); without it, the
    # format's words, which a layout alone does not give.
    assert precisions == [("int8", "bf16"), (None, "fp8"), (None, "fp16")]


def by_node(report):
    return {row.node: row for row in report.rows}


@SCHEMAS
def test_join_with_builder_log_shows_what_tensorrt_did_not_take(mlp, suffix):
    inspection, order = mlp
    log = parse_builder_log((FIXTURES / "mlp-trtexec.log").read_text())
    layers = parse_layer_information(inspector_fixture("mlp-layers", suffix))
    report = join_report(inspection, order, log, layers)
    rows = by_node(report)
    assert {node: row.status for node, row in rows.items()} == {
        "/fc1/Gemm": SPARSE,
        "/fc2/Gemm": DENSE_CHOSEN,
        "/fc3/Gemm": MISSED,  # 2:4 and fp16, so predicted eligible, but TensorRT did not list it
        "/head/MatMul": NOT_ELIGIBLE,
    }
    assert rows["/fc1/Gemm"].trt_layer == "/fc1/Gemm + /act/Relu" and "sptensor" in rows["/fc1/Gemm"].tactic
    assert not rows["/head/MatMul"].predicted_eligible
    assert rows["/head/MatMul"].predicted_reasons[0].startswith("not 2:4 along the reduction axis")
    summary = report.summary()
    assert (summary["predicted_eligible"], summary[SPARSE], summary[DENSE_CHOSEN], summary[MISSED]) == (3, 1, 1, 1)
    assert report.evidence == "builder log" and report.unmatched == ()
    assert report.as_dict()["layers"][0]["node"] == "/fc1/Gemm"


@SCHEMAS
def test_join_falls_back_on_the_inspector_and_says_when_it_knows_nothing(mlp, suffix):
    inspection, order = mlp
    layers = parse_layer_information(inspector_fixture("mlp-layers", suffix))
    report = join_report(inspection, order, SparsityLog(None, None), layers)
    assert report.evidence == "engine inspector"
    assert [by_node(report)[n].status for n in ("/fc1/Gemm", "/fc2/Gemm", "/fc3/Gemm")] == [
        SPARSE,
        DENSE_CHOSEN,
        MISSED,
    ]
    names_only = parse_layer_information((FIXTURES / "mlp-layers-names-only.json").read_text())
    report = join_report(inspection, order, SparsityLog(None, None), names_only)
    assert report.evidence == "none" and {row.status for row in report.rows} == {UNKNOWN}
    # Log names that match no ONNX node are reported rather than dropped.
    report = join_report(inspection, order, SparsityLog(("Conv_0 + Relu_1",), ()), ())
    assert report.unmatched == ("Conv_0 + Relu_1",) and by_node(report)["/fc1/Gemm"].status == MISSED


def test_fp32_models_get_the_cast_first_warning(tmp_path, mlp):
    fp32 = OnnxModel.load(sparse_mlp(tmp_path / "fp32.onnx", precision="fp32"))
    warning = fp32_sparse_warning(inspect_model(fp32))
    assert "4 eligible weights" in warning and "nmdeploy cast" in warning
    assert fp32_sparse_warning(mlp[0]) is None


def test_shape_profiles_in_trtexec_syntax():
    low, opt, high = parse_shapes("ids:1x128"), parse_shapes("ids:8x128"), parse_shapes("ids:32x128")
    assert shape_ranges(low=low, opt=opt, high=high) == {"ids": ((1, 128), (8, 128), (32, 128))}
    assert shape_ranges(parse_shapes("input:0:4x3,mask:4")) == {"input:0": ((4, 3),) * 3, "mask": ((4,),) * 3}
    for bad, message in [
        ("ids", "expected NAME:DIMS"),
        ("ids:1xa", "integers"),
        ("ids:Bx1", "integers"),
        ("", "expected NAME:DIMS"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_shapes(bad)
    with pytest.raises(InputError, match="given twice"):
        parse_shapes("ids:1x2,ids:1x3")
    for ranges, message in [
        ({"low": low, "opt": opt}, "needs --max-shapes too"),
        ({"low": low, "opt": parse_shapes("ids:8x64x2"), "high": high}, "same rank"),
        ({"low": opt, "opt": low, "high": high}, "MIN <= OPT <= MAX"),
        ({"fixed": low, "low": low, "opt": opt, "high": high}, "give one"),
    ]:
        with pytest.raises(InputError, match=message):
            shape_ranges(**ranges)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_build_without_tensorrt_is_one_line_and_exit_2(mlp, tmp_path, capsys):
    model = sparse_mlp(tmp_path / "m.onnx")
    engine = tmp_path / "m.plan"
    assert main(["build", str(model), "-o", str(engine), "--sparse", "--shapes", "x:8x512"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "TensorRT is not available" in captured.err and "'nmdeploy[tensorrt]'" in captured.err
    assert "--only-binary :all: --extra-index-url https://pypi.nvidia.com" in captured.err
    assert not engine.exists()
    assert main(["build", str(model), "-o", str(engine), "--shapes", "x:8xa"]) == 2  # shapes are checked first
    assert "--shapes 'x:8xa': dimensions must be integers" in capsys.readouterr().err


# The INT8 fixtures (mlp-int8-trtexec.log, mlp-int8-layers.json) are written by hand too, for the MLP below after
# `nmdeploy quantize --precision int8`: TensorRT fuses each GEMM with the DequantizeLinear nodes before it and the
# QuantizeLinear after its epilogue, and the inspector gives each layer's input and output "Format/Datatype".


def quantized_mlp(path, precision="int8"):
    """The 2:4 MLP in fp32, quantized by QuantizePass (random calibration): fc1-fc3 INT8 (or FP8) in and out, the
    head INT8 in and fp32 out (a graph output)."""
    from nmdeploy.passes.quantize import QuantizePass

    model = OnnxModel.load(sparse_mlp(path, precision="fp32"))
    QuantizePass(calibration="random", precision=precision, smooth=False)(model)
    model.save(path)
    return path


@pytest.fixture(scope="module")
def int8_mlp(tmp_path_factory):
    model = OnnxModel.load(quantized_mlp(tmp_path_factory.mktemp("int8") / "mlp-2of4-int8.onnx"))
    return model, inspect_model(model), [node.name for node in model.proto.graph.node]


def test_inspector_formats_name_each_layers_precision():
    for text, precision in [
        ("Row major linear FP32", "fp32"),
        ("Channel major FP16 format where channel % 8 == 0", "fp16"),
        ("Thirty-two wide channel vectorized row major Int8 format", "int8"),
        ("Row major linear FP8 format", "fp8"),
        ("Row major linear BF16 format", "bf16"),
        ("Row major linear Int32", None),
    ]:
        assert format_precision(text) == precision, text
    layers = {layer.name.split(" + ")[2] if " + " in layer.name else layer.name: layer for layer in
              parse_layer_information((FIXTURES / "mlp-int8-layers.json").read_text())}  # fmt: skip
    assert (layers["x/QuantizeLinear"].input_precision, layers["x/QuantizeLinear"].output_precision) == ("fp32", "int8")
    assert (layers["/fc1/Gemm"].input_precision, layers["/fc1/Gemm"].output_precision) == ("int8", "int8")
    assert (layers["/head/MatMul"].input_precision, layers["/head/MatMul"].output_precision) == ("int8", "fp32")


def test_fp8_layers_count_for_sparse_fp8_kernels_whatever_their_output_int8_only_in_and_out():
    def row(precision: str, status: str = SPARSE) -> LayerRow:
        return LayerRow("n", "MatMul", "w", True, (), "t", True, status == SPARSE, None, status, precision)

    expected = {
        "int8": "int8",
        "int8 in, fp16 out": None,  # sparse INT8 kernels are INT8 in and out
        "int8 in": None,  # the ONNX graph's reading: the output is TensorRT's choice, unknown
        "fp8": "fp8",
        "fp8 in, bf16 out": "fp8",  # sparse FP8 GEMMs write fp16/bf16/fp32
        "fp8 in": "fp8",
        "fp8 weight, float in": None,
        "fp16": None,
    }
    assert {precision: row(precision).sparse_kernel_precision for precision in expected} == expected
    report = EngineReport((row("fp8 in, fp16 out"), row("fp8", DENSE_CHOSEN), row("int8 in, fp16 out")), (), "none")
    assert report.quantized_lines() == ["2:4 + FP8 in: 1 of 2 layers picked sparse FP8 kernels"]


@SCHEMAS
def test_int8_report_splits_layers_by_precision_and_counts_sparse_integer_kernels(int8_mlp, suffix):
    model, inspection, order = int8_mlp
    log = parse_builder_log((FIXTURES / "mlp-int8-trtexec.log").read_text())
    layers = parse_layer_information(inspector_fixture("mlp-int8-layers", suffix))
    report = join_report(inspection, order, log, layers, graph_precisions(model, inspection))
    rows = by_node(report)
    assert {node: (row.status, row.precision) for node, row in rows.items()} == {
        "/fc1/Gemm": (SPARSE, "int8"),
        "/fc2/Gemm": (DENSE_CHOSEN, "int8"),  # INT8 in and out, 2:4, but a dense INT8 tactic timed faster
        "/fc3/Gemm": (SPARSE, "int8"),
        "/head/MatMul": (NOT_ELIGIBLE, "int8 in, fp32 out"),
    }
    assert {row.precision_from for row in report.rows} == {"engine inspector"}
    assert report.quantized_lines() == ["2:4 + INT8 in/out: 2 of 3 layers picked sparse integer kernels"]
    assert report.by_precision() == {
        "int8": {"layers": 3, "predicted_eligible": 3, SPARSE: 2},
        "int8 in, fp32 out": {"layers": 1, "predicted_eligible": 0, SPARSE: 0},
    }
    document = report.as_dict()
    assert document["quantized"] == report.quantized_lines() and document["layers"][0]["precision"] == "int8"


@SCHEMAS
def test_fp16_engine_reports_no_integer_layers(mlp, suffix):
    inspection, order = mlp
    log = parse_builder_log((FIXTURES / "mlp-trtexec.log").read_text())
    report = join_report(inspection, order, log, parse_layer_information(inspector_fixture("mlp-layers", suffix)))
    assert by_node(report)["/fc1/Gemm"].precision == "fp16" and by_node(report)["/fc1/Gemm"].status == SPARSE
    assert report.quantized_lines() == []  # sparse, but fp16: no "sparse integer kernels" line


def test_without_inspector_formats_the_graph_gives_the_precision_but_not_the_output(int8_mlp, tmp_path):
    model, inspection, order = int8_mlp
    names_only = parse_layer_information((FIXTURES / "mlp-layers-names-only.json").read_text())
    log = parse_builder_log((FIXTURES / "mlp-int8-trtexec.log").read_text())
    report = join_report(inspection, order, log, names_only, graph_precisions(model, inspection))
    assert {row.precision for row in report.rows} == {"int8 in"}
    assert {row.precision_from for row in report.rows} == {"ONNX graph"}
    assert report.quantized_lines() == []  # only the engine shows whether an output stayed INT8
    fp8 = OnnxModel.load(quantized_mlp(tmp_path / "fp8.onnx", "fp8"))
    assert set(graph_precisions(fp8, inspect_model(fp8)).values()) == {"fp8 in"}
    assert quantized_types(fp8) == {"fp8"} and quantized_types(model) == {"int8"}
    fp32 = OnnxModel.load(sparse_mlp(tmp_path / "fp32.onnx", precision="fp32"))
    assert quantized_types(fp32) == frozenset()
    assert set(graph_precisions(fp32, inspect_model(fp32)).values()) == {"fp32"}


def test_asymmetric_uint8_qdq_is_named_as_such(tmp_path):
    """ONNX's default QuantizeLinear (no zero point, no output_dtype) is UINT8: not what TensorRT's kernels take."""
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s"], ["q"], name="q"),
            helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="dq"),
        ],
        "uint8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array(0.1, np.float32), "s")],
    )
    path = tmp_path / "uint8.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    assert quantized_types(OnnxModel.load(path)) == {"uint8"}


def test_quantized_weights_get_no_cast_first_warning(int8_mlp):
    assert fp32_sparse_warning(int8_mlp[1]) is None  # INT8 weights behind DequantizeLinear: nothing to cast


def test_weight_only_int8_matmul_is_named_weight_only(tmp_path):
    # MatMul(x, DequantizeLinear(W)): the weight is the second input, read through the DequantizeLinear
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, size=(64, 32), dtype=np.int8)
    weight[:, :] *= np.tile([1, 1, 0, 0], 16)[:, None].astype(np.int8)  # 2:4 along the reduction axis (rows)
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=1, name="dq"),
            helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul"),
        ],
        "weight-only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])],
        [numpy_helper.from_array(weight, "w_q"), numpy_helper.from_array(np.full(32, 0.01, np.float32), "w_scale")],
    )
    path = tmp_path / "weight-only.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    model = OnnxModel.load(path)
    inspection = inspect_model(model)
    assert [row.inputs for row in inspection.rows] == [(1,)]
    assert graph_precisions(model, inspection) == {"matmul": "int8 weight, float in"}
