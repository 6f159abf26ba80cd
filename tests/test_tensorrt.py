"""Real TensorRT builds (``pytest -m tensorrt``): they need TensorRT 10 or 11 and an NVIDIA GPU and skip without them
(install: README, "Extras")."""

import numpy as np
import onnxruntime as ort
import pytest
from test_engine_report import sparse_mlp

from nmdeploy.errors import Error, InputError
from nmdeploy.runtimes.engine_report import DENSE_CHOSEN, SPARSE, build_with_report

pytestmark = pytest.mark.tensorrt


@pytest.fixture(scope="module")
def tensorrt():
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (README, Extras: 'nmdeploy[tensorrt]')")
    try:
        trt.Builder(trt.Logger(trt.Logger.ERROR))
    except Exception as error:  # no GPU or no CUDA driver
        pytest.skip(f"TensorRT cannot start a builder here: {error}")
    return trt


def test_sparse_fp16_build_lists_the_2of4_layers_as_eligible(tensorrt, tmp_path):
    model = sparse_mlp(tmp_path / "mlp.onnx", width=1024, batch=256)
    cache = tmp_path / "timing.cache"
    outcome = build_with_report(model, tmp_path / "mlp.plan", sparse=True, timing_cache=cache, workspace_mib=1024)
    assert outcome.engine.is_file() and cache.is_file() and outcome.strongly_typed and not outcome.warnings
    rows = {row.node: row for row in outcome.report.rows}
    for node in ("/fc1/Gemm", "/fc2/Gemm"):
        assert rows[node].trt_eligible, rows[node]
        assert rows[node].status in (SPARSE, DENSE_CHOSEN)
    assert not rows["/head/MatMul"].trt_eligible
    # The engine's I/O from the inspector: names in TensorRT 10's "Bindings", objects in 11's "I/O Tensors".
    engine_io = outcome.report.engine_io
    assert [tensor.name for tensor in engine_io] == ["x", "y"]
    if int(tensorrt.__version__.split(".")[0]) >= 11:
        assert [(tensor.mode, tensor.precision) for tensor in engine_io] == [("input", "fp32"), ("output", "fp32")]

    from nmdeploy.runtimes.tensorrt import TensorRTRunner

    feeds = {"x": np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)}
    expected = ort.InferenceSession(str(model)).run(None, feeds)[0]
    with TensorRTRunner(outcome.engine) as runner:
        actual = runner.infer(feeds)["y"]
    assert np.abs(actual - expected).max() < 5e-2 * np.abs(expected).max()


def test_build_errors_are_one_line(tensorrt, tmp_path):
    model = sparse_mlp(tmp_path / "mlp.onnx")
    with pytest.raises(InputError, match="--shapes names nothing"):
        build_with_report(model, tmp_path / "x.plan", shapes={"nothing": ((1, 2),) * 3})
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    with pytest.raises(Error):
        build_with_report(broken, tmp_path / "y.plan")


def test_int8_qdq_build_is_strongly_typed_and_reports_int8_layers(tensorrt, tmp_path):
    from test_engine_report import quantized_mlp

    model = quantized_mlp(tmp_path / "mlp-int8.onnx")
    outcome = build_with_report(model, tmp_path / "mlp-int8.plan", sparse=True, workspace_mib=1024)
    assert outcome.engine.is_file() and outcome.strongly_typed and not outcome.warnings
    rows = {row.node: row for row in outcome.report.rows}
    for node in ("/fc1/Gemm", "/fc2/Gemm"):
        assert rows[node].precision is not None and rows[node].precision.startswith("int8"), rows[node]
        assert rows[node].trt_eligible, rows[node]
