"""New values of external tensors past the in-memory limit wait in a scratch file: reads, copies and saves see them
exactly as if they were held in memory, and the model holds at most the limit."""

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import nmdeploy.graph.model as model_module
from nmdeploy.cli import main
from nmdeploy.graph.model import OnnxModel


def external_model(folder, seed=0):
    """x [batch, 8, 64] through three 64x64 MatMuls with ReLUs, every weight in one external data file."""
    rng = np.random.default_rng(seed)
    weights = [
        numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), f"w{i}") for i in range(3)
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("Relu", ["h0"], ["r0"]),
        helper.make_node("MatMul", ["r0", "w1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 64])],
        weights,
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, path, save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    x = rng.standard_normal((16, 8, 64)).astype(np.float32)
    np.savez(folder / "calib.npz", x=x)
    return path, folder / "calib.npz"


def test_spilled_values_read_copy_and_save_as_kept_ones(tmp_path, monkeypatch):
    path, _ = external_model(tmp_path / "in")
    monkeypatch.setattr(model_module, "PATCH_MEMORY_LIMIT", 64 * 64 * 4)  # one weight in memory, the rest spilled
    model = OnnxModel.load(path)
    tensors = {t.name: t for t in model.proto.graph.initializer}
    new = {name: np.full((64, 64), k + 1, np.float32) for k, name in enumerate(tensors)}
    for name, values in new.items():
        model.write(tensors[name], values)
    assert model._patches_in_memory() == 64 * 64 * 4
    assert model._scratch.size == 2 * 64 * 64 * 4  # two weights wait on disk
    twin = copy.deepcopy(model)
    twin_tensors = {t.name: t for t in twin.proto.graph.initializer}
    for name, values in new.items():
        assert model.is_modified(tensors[name])
        read = model.read(tensors[name])
        np.testing.assert_array_equal(read, values)
        assert not read.flags.writeable
        np.testing.assert_array_equal(twin.read(twin_tensors[name]), values)
    # A later write replaces a spilled value; the copy keeps its own.
    model.write(tensors["w2"], np.zeros((64, 64), np.float32))
    np.testing.assert_array_equal(model.read(tensors["w2"]), 0)
    np.testing.assert_array_equal(twin.read(twin_tensors["w2"]), new["w2"])
    out = model.save(tmp_path / "out" / "model.onnx")
    saved = {t.name: numpy_helper.to_array(t, base_dir=str(out.parent)) for t in onnx.load(str(out)).graph.initializer}
    np.testing.assert_array_equal(saved["w0"], new["w0"])
    np.testing.assert_array_equal(saved["w1"], new["w1"])
    np.testing.assert_array_equal(saved["w2"], 0)


@pytest.mark.parametrize("limit", [0])
def test_convert_writes_the_same_model_whether_new_weights_wait_on_disk_or_not(tmp_path, monkeypatch, limit):
    path, calibration = external_model(tmp_path / "in")
    monkeypatch.setattr(model_module, "PATCH_MEMORY_LIMIT", limit)
    output = tmp_path / f"out{limit}" / "m.onnx"
    assert main(["convert", str(path), "-o", str(output), "--calib", str(calibration), "--max-memory", "2048"]) == 0
    monkeypatch.setattr(model_module, "PATCH_MEMORY_LIMIT", 1 << 30)
    reference = tmp_path / "reference" / "m.onnx"
    assert main(["convert", str(path), "-o", str(reference), "--calib", str(calibration), "--max-memory", "2048"]) == 0
    converted = tmp_path / f"out{limit}" / "m.onnx"
    assert (converted.parent / "m.onnx.data").read_bytes() == (reference.parent / "m.onnx.data").read_bytes()
    assert (converted.parent / "m.onnx.data").read_bytes() != (path.parent / "model.onnx.data").read_bytes()


def test_weights_written_from_several_threads_each_keep_their_own_values(tmp_path, monkeypatch):
    """prune writes weights from a thread pool: concurrent spills must not share a range of the scratch file."""
    from concurrent.futures import ThreadPoolExecutor

    path, _ = external_model(tmp_path / "in")
    monkeypatch.setattr(model_module, "PATCH_MEMORY_LIMIT", 0)
    model = OnnxModel.load(path)
    tensors = list(model.proto.graph.initializer)
    new = {t.name: np.full((64, 64), k + 1, np.float32) for k, t in enumerate(tensors)}
    for _ in range(20):
        with ThreadPoolExecutor(max_workers=3) as pool:
            list(pool.map(lambda t: model.write(t, new[t.name]), tensors))
    for tensor in tensors:
        np.testing.assert_array_equal(model.read(tensor), new[tensor.name])
    assert model._patches_in_memory() == 0
