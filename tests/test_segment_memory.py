"""What a calibration segment keeps resident: external weights are mapped, not read, so a run holds only the pages
it touches (a token embedding's Gather: the rows of the tokens fed), and an output kept past its ONNX Runtime
session keeps that output alone, not the session's intermediates."""

import gc
import mmap
import tracemalloc

import numpy as np
import onnx
from onnx import TensorProto, helper

from nmdeploy.calibration.statistics.segments import SegmentPlan, SegmentSession
from nmdeploy.graph.model import OnnxModel
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeGraphRunner

MB = 1 << 20
VOCAB, WIDTH = 65536, 1024  # a 256 MB float32 token embedding


def _resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _external(name: str, shape: tuple[int, ...], offset: int) -> onnx.TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=shape, data_location=TensorProto.EXTERNAL)
    length = int(np.prod(shape)) * 4
    for key, value in (("location", "weights.data"), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _embedding_model(folder) -> OnnxModel:
    """ids -> Gather(embedding) -> MatMul(projection): the embedding (256 MB) and the projection in external data,
    at offsets no mapping granule starts at."""
    rng = np.random.default_rng(0)
    with open(folder / "weights.data", "wb") as handle:
        handle.write(b"\0" * 100)
        for _ in range(VOCAB // 8192):  # a piece at a time: the test holds no second copy of the table
            handle.write(rng.standard_normal((8192, WIDTH), dtype=np.float32).tobytes())
        handle.write(rng.standard_normal((WIDTH, 8), dtype=np.float32).tobytes())
    rows = [_external("embedding", (VOCAB, WIDTH), 100), _external("projection", (WIDTH, 8), 100 + VOCAB * WIDTH * 4)]
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embedding", "ids"], ["hidden"]),
            helper.make_node("MatMul", ["hidden", "projection"], ["y"]),
        ],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16, 8])],
        rows,
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), folder / "m.onnx")
    return OnnxModel.load(folder / "m.onnx")


def test_external_weights_are_mapped_read_only_with_the_values_read_gives(tmp_path):
    model = _embedding_model(tmp_path)
    embedding, projection = model.proto.graph.initializer
    mapped = model.mapped(projection)
    base = mapped
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)
    assert not mapped.flags.writeable
    np.testing.assert_array_equal(mapped, model.read(projection))
    # A replaced tensor comes back with its new values, not the file's.
    model.write(projection, np.ones((WIDTH, 8), np.float32))
    assert model.mapped(projection).sum() == WIDTH * 8
    np.testing.assert_array_equal(model.mapped(embedding)[:3], model.read(embedding)[:3])


def test_a_segment_holds_the_embedding_rows_it_gathers_not_the_table(tmp_path):
    model = _embedding_model(tmp_path)
    # Token ids of text cluster in part of the vocabulary; here 64 of the first 2048 (8 MB of the table's 256 MB).
    ids = np.arange(64, dtype=np.int64).reshape(4, 16) * 31
    expected = model.read(model.proto.graph.initializer[0])[ids] @ model.read(model.proto.graph.initializer[1])
    gc.collect()
    before = _resident_mb()
    plan = SegmentPlan(model.index, [["y"]], ())
    session = SegmentSession(model, plan, plan.segments[0], {})
    (y,) = session.run({"ids": ids}).values()
    grown = _resident_mb() - before
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)
    # Reading the table would have cost 256 MB; the run touched 64 rows of 4 KB (the kernel maps the page cache's
    # folios around them, up to 2 MB each), and ONNX Runtime's session took its own.
    assert grown < 64, f"resident memory grew {grown:.0f} MB for 64 embedding rows"


def test_an_output_kept_past_its_session_keeps_no_intermediates(tmp_path):
    rows, wide = 8192, 4096  # intermediates of 128 MB each
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "up"], ["h"]),
            helper.make_node("Sigmoid", ["h"], ["s"]),
            helper.make_node("Mul", ["h", "s"], ["g"]),
            helper.make_node("MatMul", ["g", "down"], ["y"]),
        ],
        "wide",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 64]),
            helper.make_tensor_value_info("up", TensorProto.FLOAT, [64, wide]),
            helper.make_tensor_value_info("down", TensorProto.FLOAT, [wide, 64]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 64])],
    )
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    up = rng.standard_normal((64, wide), dtype=np.float32) / 8
    down = rng.standard_normal((wide, 64), dtype=np.float32) / 64
    gc.collect()
    before = _resident_mb()
    kept = []
    for _ in range(3):  # three sessions, as three calibration stages, each output kept for a later one
        runner = OnnxRuntimeGraphRunner(proto, {"up": up, "down": down})
        kept.append(runner.run({"x": x})["y"])
        del runner
    gc.collect()
    grown = _resident_mb() - before
    assert all(np.isfinite(value).all() for value in kept)
    # The outputs are 2 MB each; three sessions' arenas (two 128 MB intermediates each) would be 768 MB or more.
    assert grown < 128, f"resident memory grew {grown:.0f} MB for three kept outputs of 2 MB"


def test_inspection_reads_a_large_external_weight_a_piece_at_a_time(tmp_path):
    side = 8192  # a 256 MB float32 MatMul weight, its first half of rows half zeros
    rng = np.random.default_rng(0)
    with open(tmp_path / "weights.data", "wb") as handle:
        handle.write(b"\0" * 100)
        for start in range(0, side, 1024):
            rows = rng.standard_normal((1024, side), dtype=np.float32)
            if start < side // 2:
                rows[:, 0::4] = rows[:, 1::4] = 0  # two zeros in every group of 4 along each row
            handle.write(rows.tobytes())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "weight"], ["y"])],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", side])],
        [_external("weight", (side, side), 100)],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    model = OnnxModel.load(tmp_path / "m.onnx")
    (tensor,) = model.proto.graph.initializer
    pieces = list(model.read_pieces(tensor, elements=3 * side))
    assert [len(piece) for piece in pieces] == [3] * (side // 3) + [side % 3]
    np.testing.assert_array_equal(np.concatenate(pieces[:4]), model.read(tensor)[:12])
    del pieces

    from nmdeploy.graph.inspection import inspect_model

    tracemalloc.start()
    try:
        (row,) = inspect_model(model).rows
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert abs(row.sparsity - 0.25) < 1e-6  # half the rows are half zeros (random normals are almost never 0)
    # Read whole, the weight (256 MB) and its mask (64 MB) were held together.
    assert peak < 256 * MB, f"inspection held {peak / MB:.0f} MB for a 256 MB weight"
