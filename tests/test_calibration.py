"""Activation statistics: H = X^T X of each weight's GEMM input, checked against a direct numpy computation."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.calibration.statistics import collect_statistics, fitting_stages
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel


@pytest.mark.parametrize("external", [True, False])
def test_second_moments_match_the_activations(tmp_path, external):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)  # MatMul B [K=16, N=32]
    w2 = rng.standard_normal((8, 32)).astype(np.float32)  # Gemm transB=1 [N=8, K=32]
    w3 = rng.standard_normal((4, 8)).astype(np.float32)  # MatMul A-side: y3 = W3 @ y^T, K = 8
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "W2"], ["y"], transB=1),
        helper.make_node("Transpose", ["y"], ["yt"]),
        helper.make_node("MatMul", ["W3", "yt"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(w3, "W3")],
    )
    # The Gemm needs 2-D input, so the token axis is folded in by a model that feeds [batch*3, 16] rows.
    graph.node.insert(0, helper.make_node("Reshape", ["x", "flat"], ["x2"]))
    graph.node[1].input[0] = "x2"
    graph.initializer.append(numpy_helper.from_array(np.array([-1, 16], np.int64), "flat"))
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save(proto, tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    else:
        onnx.save(proto, tmp_path / "m.onnx")
    model = OnnxModel.load(tmp_path / "m.onnx")
    weights = find_prunable_weights(model.proto).weights
    batches = [{"x": rng.standard_normal((2, 3, 16)).astype(np.float32)} for _ in range(3)]
    stats, skipped = collect_statistics(model, weights, batches)
    assert skipped == {} and set(stats) == {"W1", "W2", "W3"}

    x = np.concatenate([b["x"].reshape(-1, 16) for b in batches]).astype(np.float64)
    r = np.maximum(x @ w1, 0)
    y = r @ w2.T
    expected = {"W1": x.T @ x, "W2": r.T @ r, "W3": y.T @ y}  # W3 @ y^T reduces over y's last axis (K = 8)
    for name, h in expected.items():
        np.testing.assert_allclose(stats[name].hessian.numpy(), h, rtol=1e-5, atol=1e-4)
        assert stats[name].samples == 18
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["m.onnx", "m.onnx.data"] if external else ["m.onnx"])  # no temporary copy left behind


def _patches(x: np.ndarray, kernel, strides, dilations, pads) -> np.ndarray:
    """Independent im2col by explicit loops: rows of (r, s, c) patch values, one per output position."""
    top, left, bottom, right = pads
    x = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    out_h = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for b in range(x.shape[0]):
        for i in range(out_h):
            for j in range(out_w):
                window = x[b, :, i * sh : i * sh + dh * (kh - 1) + 1 : dh, j * sw : j * sw + dw * (kw - 1) + 1 : dw]
                rows.append(window.transpose(1, 2, 0).reshape(-1))
    return np.array(rows)


@pytest.mark.parametrize(
    "kernel, strides, dilations, pads",
    [
        ((3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
        ((3, 2), (2, 1), (1, 2), (0, 1, 2, 0)),
        ((1, 1), (1, 1), (1, 1), (0,) * 4),
    ],
)
def test_convolution_statistics_are_channel_fastest_im2col(tmp_path, kernel, strides, dilations, pads):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 4, *kernel)).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "C"], ["y"], strides=strides, dilations=dilations, pads=pads)
    graph = helper.make_graph(
        [conv],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4, 7, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "C")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "c.onnx")
    model = OnnxModel.load(tmp_path / "c.onnx")
    batches = [{"x": rng.standard_normal((2, 4, 7, 6)).astype(np.float32)} for _ in range(2)]
    stats, skipped = collect_statistics(model, find_prunable_weights(model.proto).weights, batches)
    assert skipped == {}
    patches = np.concatenate([_patches(b["x"].astype(np.float64), kernel, strides, dilations, pads) for b in batches])
    np.testing.assert_allclose(stats["C"].hessian.numpy(), patches.T @ patches, rtol=1e-5, atol=1e-4)  # fp32 per batch
    assert stats["C"].samples == len(patches)
    # The weight flattened channel-fastest is the matrix these rows multiply: the convolution is patches @ W^T.
    import onnxruntime

    y = onnxruntime.InferenceSession(str(tmp_path / "c.onnx")).run(None, batches[0])[0]
    matrix = w.transpose(0, 2, 3, 1).reshape(8, -1)
    first = _patches(batches[0]["x"].astype(np.float64), kernel, strides, dilations, pads)
    np.testing.assert_allclose(first @ matrix.T, y.transpose(0, 2, 3, 1).reshape(-1, 8), rtol=1e-4, atol=1e-4)


def test_unsupported_convolutions_are_reported_not_guessed(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "G"], ["y"], group=2),
        helper.make_node("Conv", ["v", "D"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 5, 5]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 8, 3, 3, 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
        ],
        [
            numpy_helper.from_array(np.ones((8, 4, 1, 1), np.float32), "G"),
            numpy_helper.from_array(np.ones((8, 8, 1, 1, 1), np.float32), "D"),
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "c.onnx")
    model = OnnxModel.load(tmp_path / "c.onnx")
    stats, skipped = collect_statistics(model, find_prunable_weights(model.proto).weights, [])
    assert stats == {}
    assert "grouped convolution" in skipped["G"] and "3-D convolution" in skipped["D"]


def test_fitting_stages_put_side_by_side_weights_together_and_order_the_chain(tmp_path):
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "Q"], ["q"]),
        helper.make_node("MatMul", ["x", "K"], ["k"]),
        helper.make_node("Add", ["q", "k"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("Gemm", ["r", "O"], ["o"], transB=1),
        helper.make_node("MatMul", ["o", "F"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
            for name, shape in (("Q", (8, 8)), ("K", (8, 8)), ("O", (8, 8)), ("F", (8, 4)))
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    model = OnnxModel.load(tmp_path / "m.onnx")
    weights = find_prunable_weights(model.proto).weights
    stages = fitting_stages(model, list(reversed(weights)))
    assert [sorted(w.name for w in stage) for stage in stages] == [["K", "Q"], ["O"], ["F"]]
    # Without O among the weights, F depends only on Q and K.
    stages = fitting_stages(model, [w for w in weights if w.name != "O"])
    assert [sorted(w.name for w in stage) for stage in stages] == [["K", "Q"], ["F"]]


@pytest.mark.parametrize(
    "kernel, strides, dilations, pads",
    [
        ((3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
        ((3, 2), (2, 1), (1, 2), (0, 1, 2, 0)),
        ((1, 1), (2, 2), (1, 1), (0,) * 4),  # the 1x1 shortcut, strided
    ],
)
@pytest.mark.parametrize("chunk_elements", [1 << 24, 100])  # whole samples at once; bands of output rows
def test_convolution_rows_and_outputs_come_in_the_same_chunks(kernel, strides, dilations, pads, chunk_elements):
    import torch

    from nmdeploy.calibration.statistics.taps import ConvGeometry

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 9, 8)).astype(np.float32)
    matrix = torch.from_numpy(rng.standard_normal((5, 4 * kernel[0] * kernel[1])).astype(np.float32))
    # ConvGeometry's pads are (left, right, top, bottom), _patches' (top, left, bottom, right).
    geometry = ConvGeometry(kernel, strides, dilations, (pads[1], pads[3], pads[0], pads[2]))
    rows = list(geometry.patch_chunks(torch.from_numpy(x), chunk_elements))
    outputs = list(geometry.output_chunks(torch.from_numpy(x), matrix, chunk_elements))
    assert len(rows) == len(outputs) >= (1 if chunk_elements > 1000 else 3)
    patches = _patches(x.astype(np.float64), kernel, strides, dilations, pads)
    np.testing.assert_allclose(torch.cat(rows).numpy(), patches, rtol=1e-6, atol=1e-6)
    for chunk, output in zip(rows, outputs, strict=True):
        np.testing.assert_allclose(output.numpy(), (chunk @ matrix.T).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 100])
def test_same_lower_rows_and_outputs_are_padded_per_batch_as_onnx_defines(chunk_elements):
    import torch

    from nmdeploy.calibration.statistics.taps import ConvGeometry

    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    matrix = torch.from_numpy(rng.standard_normal((5, 4 * 6)).astype(np.float32))
    # 9 rows, kernel 2, stride 2: 5 outputs need 1 pixel, on top for SAME_LOWER; 8 columns, kernel 3: 1, on the left.
    geometry = ConvGeometry((2, 3), (2, 2), (1, 1), (0, 0, 0, 0), auto_pad="SAME_LOWER")
    rows = torch.cat(list(geometry.patch_chunks(torch.from_numpy(x), chunk_elements)))
    outputs = torch.cat(list(geometry.output_chunks(torch.from_numpy(x), matrix, chunk_elements)))
    patches = _patches(x.astype(np.float64), (2, 3), (2, 2), (1, 1), (1, 1, 0, 0))
    assert rows.shape == (2 * 5 * 4, 24)
    np.testing.assert_allclose(rows.numpy(), patches, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outputs.numpy(), (rows @ matrix.T).numpy(), rtol=1e-4, atol=1e-4)


def _conv_model(path, w, shape, **attributes):
    conv = helper.make_node("Conv", ["x", "C"], ["y"], name="/features/conv", **attributes)
    graph = helper.make_graph(
        [conv],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, *shape[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "C")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return OnnxModel.load(path)


@pytest.mark.parametrize(
    "auto_pad, shape, kernel, strides, pads",
    [
        # 7 rows, kernel 3, stride 2: 4 outputs need 2 pixels of padding; 7 columns, kernel 2: 1, odd, at the end
        ("SAME_UPPER", (2, 4, 7, 7), (3, 2), (2, 2), [1, 0, 1, 1]),
        ("SAME_LOWER", (2, 4, 7, 7), (3, 2), (2, 2), [1, 1, 1, 0]),
        ("SAME_UPPER", (2, 4, 9), (4,), (2,), [1, 2]),  # 1-D: 5 outputs of 9 need 3 pixels, the odd one at the end
    ],
)
def test_auto_pad_statistics_match_the_explicit_pads_onnx_runtime_agrees_with(
    tmp_path, auto_pad, shape, kernel, strides, pads
):
    import onnxruntime

    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 4, *kernel)).astype(np.float32)
    same = _conv_model(tmp_path / "same.onnx", w, shape, auto_pad=auto_pad, strides=strides)
    explicit = _conv_model(tmp_path / "explicit.onnx", w, shape, pads=pads, strides=strides)
    batches = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(2)]
    # The hand-written pads are the ones ONNX Runtime applies for auto_pad: both models compute the same outputs.
    outputs = [
        onnxruntime.InferenceSession(str(tmp_path / f"{n}.onnx")).run(None, batches[0])[0] for n in ("same", "explicit")
    ]
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)
    stats, skipped = collect_statistics(same, find_prunable_weights(same.proto).weights, batches)
    reference, _ = collect_statistics(explicit, find_prunable_weights(explicit.proto).weights, batches)
    assert skipped == {}
    assert stats["C"].samples == reference["C"].samples == outputs[0][0, 0].size * 2 * shape[0]
    np.testing.assert_allclose(stats["C"].hessian.numpy(), reference["C"].hessian.numpy(), rtol=1e-6, atol=1e-5)


def test_convert_converts_a_same_upper_convolution(tmp_path, capsys):
    from nmdeploy.cli import main
    from nmdeploy.graph.inspection import inspect_model
    from nmdeploy.passes.conversion_report import ConvertedWeight
    from nmdeploy.passes.convert import ConvertPass

    w = np.random.default_rng(3).standard_normal((8, 8, 3, 3)).astype(np.float32)
    model = _conv_model(tmp_path / "same.onnx", w, (1, 8, 7, 7), auto_pad="SAME_UPPER", strides=[2, 2])
    rows = ConvertPass(calibration="random", progress=False)(model).report
    converted = [row for row in rows if isinstance(row, ConvertedWeight)]
    assert [(row.weight, row.node, row.skipped) for row in converted] == [("C", "/features/conv", None)]
    assert converted[0].samples > 0
    assert inspect_model(model).rows[0].compliant == 1.0
    # From the command line: the one eligible weight converted, so --require passes on the written model.
    out = tmp_path / "out.onnx"
    assert main(["convert", str(tmp_path / "same.onnx"), "-o", str(out), "--calib", "random", "--require"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"PASSED | converted 1 weights to 2:4 -> {out}"
