"""Pruning ONNX models: masks along the traced axis, byte-for-byte fidelity elsewhere, external data, bad input."""

import hashlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks import is_nm, is_transposable
from nmdeploy.passes import prune

IR_VERSION = 10  # what the installed onnxruntime reads


def build_mlp(dtype=np.float32, extra_metadata=True):
    rng = np.random.default_rng(0)
    onnx_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm", doc_string="first layer"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "W2", "b2"], ["y"], transB=1, name="fc"),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 32)).astype(dtype), "W1"),
        numpy_helper.from_array(rng.standard_normal((8, 32)).astype(dtype), "W2"),
        numpy_helper.from_array(rng.standard_normal(8).astype(dtype), "b2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", onnx_type, [2, 16])],
        [helper.make_tensor_value_info("y", onnx_type, [2, 8])],
        inits,
        value_info=[helper.make_tensor_value_info("h", onnx_type, [2, 32])],
        doc_string="graph doc",
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 3)],
        ir_version=IR_VERSION,
        producer_name="tests",
        doc_string="model doc",
    )
    if extra_metadata:
        helper.set_model_props(model, {"author": "nmdeploy tests", "license": "none"})
    return model


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tensor(model, name, base_dir=None):
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name), base_dir=base_dir).copy()


def test_prune_is_faithful_except_the_pruned_values(tmp_path):
    source = tmp_path / "mlp.onnx"
    proto = build_mlp()
    # A local function and a custom opset domain must survive too (polygraphy drops both).
    proto.functions.append(
        helper.make_function(
            "com.example",
            "Twice",
            ["a"],
            ["b"],
            [helper.make_node("Add", ["a", "a"], ["b"])],
            [helper.make_opsetid("", 17)],
            doc_string="kept as is",
        )
    )
    onnx.save(proto, source)
    before = digest(source)
    model = OnnxModel.load(source)
    result = prune(model, pattern="2:4")
    assert result.modified
    model.save(tmp_path / "out.onnx")
    assert digest(source) == before  # the input is never modified

    original, pruned = onnx.load(source), onnx.load(tmp_path / "out.onnx")
    w1, w2 = torch.from_numpy(tensor(pruned, "W1")), torch.from_numpy(tensor(pruned, "W2"))
    assert is_nm(w1, "2:4", axis=0).fraction == 1.0  # MatMul B [K, N]: groups along K
    assert is_nm(w2, "2:4", axis=1).fraction == 1.0  # Gemm transB=1 [N, K]: groups along K
    assert np.array_equal(tensor(pruned, "b2"), tensor(original, "b2"))
    # Kept values are the original ones.
    assert np.array_equal(tensor(pruned, "W1")[w1 != 0], tensor(original, "W1")[w1.numpy() != 0])
    # Everything but the pruned tensors' bytes is identical, field by field.
    for proto in (original, pruned):
        for t in proto.graph.initializer:
            if t.name in ("W1", "W2"):
                t.ClearField("raw_data")
    assert original == pruned
    assert original.SerializeToString() == pruned.SerializeToString()

    session = ort.InferenceSession(str(tmp_path / "out.onnx"))
    output = session.run(None, {"x": np.ones((2, 16), np.float32)})[0]
    assert output.shape == (2, 8) and np.isfinite(output).all()


def test_external_data_stays_external_and_the_input_files_are_untouched(tmp_path):
    source = tmp_path / "big.onnx"
    onnx.save(build_mlp(), source, save_as_external_data=True, location="big.onnx.data", size_threshold=0)
    hashes = {p.name: digest(p) for p in tmp_path.iterdir()}
    model = OnnxModel.load(source)
    prune(model, pattern="2:4")
    model.save(tmp_path / "out.onnx")
    assert {p.name: digest(p) for p in tmp_path.iterdir() if p.name in hashes} == hashes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data", "out.onnx", "out.onnx.data"]
    pruned = onnx.load(tmp_path / "out.onnx", load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in pruned.graph.initializer)
    loaded = onnx.load(tmp_path / "out.onnx")
    assert is_nm(torch.from_numpy(tensor(loaded, "W1")), "2:4", axis=0).fraction == 1.0
    assert np.array_equal(tensor(loaded, "b2"), tensor(onnx.load(source), "b2"))
    ort.InferenceSession(str(tmp_path / "out.onnx")).run(None, {"x": np.ones((2, 16), np.float32)})


def test_in_place_save_replaces_model_and_data_atomically(tmp_path):
    source = tmp_path / "m.onnx"
    onnx.save(build_mlp(), source, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    model = OnnxModel.load(source)
    prune(model, pattern="2:4")
    model.save(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert is_nm(torch.from_numpy(tensor(onnx.load(source), "W1")), "2:4", axis=0).fraction == 1.0


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.float64])
def test_low_precision_weights_are_pruned_by_magnitude(tmp_path, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    model_proto = build_mlp(dtype=dtype)
    onnx.save(model_proto, tmp_path / "m.onnx")
    model = OnnxModel.load(tmp_path / "m.onnx")
    prune(model, pattern="2:4")
    model.save(tmp_path / "out.onnx")
    original = tensor(onnx.load(tmp_path / "m.onnx"), "W1").astype(np.float32)
    pruned = tensor(onnx.load(tmp_path / "out.onnx"), "W1").astype(np.float32)
    groups = np.abs(original).T.reshape(32, 4, 4)  # along axis 0 (K = 16) for each of 32 outputs
    kept = (pruned != 0).T.reshape(32, 4, 4)
    smallest_kept = np.where(kept, groups, np.inf).min(axis=2)
    largest_pruned = np.where(kept, -np.inf, groups).max(axis=2)
    assert (kept.sum(axis=2) == 2).all() and (smallest_kept >= largest_pruned).all()


def test_shared_weight_gets_a_transposable_mask(tmp_path):
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["x", "E"], ["h"], name="down"),
        helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Et"], ["y"], name="up"),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "E")],
    )
    onnx.save(
        helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", 17)]),
        tmp_path / "tied.onnx",
    )
    model = OnnxModel.load(tmp_path / "tied.onnx")
    result = prune(model, pattern="2:4")
    assert result.report_json()[0]["method"] == "transposable exact"
    model.save(tmp_path / "out.onnx")
    pruned = torch.from_numpy(tensor(onnx.load(tmp_path / "out.onnx"), "E"))
    assert is_transposable(pruned, "2:4", axis=0, out_axis=1).fraction == 1.0


def test_constant_node_weight_inside_a_subgraph_is_pruned(tmp_path):
    value = numpy_helper.from_array(np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32), "c")
    then_graph = helper.make_graph(
        [helper.make_node("Constant", [], ["Wc"], value=value), helper.make_node("MatMul", ["x", "Wc"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 8])],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(
        helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", 17)]),
        tmp_path / "if.onnx",
    )
    model = OnnxModel.load(tmp_path / "if.onnx")
    assert prune(model, pattern="2:4").modified
    model.save(tmp_path / "out.onnx")
    out = onnx.load(tmp_path / "out.onnx")
    then_branch = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    stored = numpy_helper.to_array(then_branch.node[0].attribute[0].t)
    assert is_nm(torch.from_numpy(stored), "2:4", axis=0).fraction == 1.0
    result = ort.InferenceSession(str(tmp_path / "out.onnx")).run(
        None, {"x": np.ones((2, 16), np.float32), "cond": np.array(True)}
    )[0]
    assert np.allclose(result, np.ones((2, 16), np.float32) @ stored)


def with_bad_value(model, value):
    weight = next(t for t in model.graph.initializer if t.name == "W1")
    values = numpy_helper.to_array(weight).copy()
    values[3, 5] = value
    weight.CopyFrom(numpy_helper.from_array(values, "W1"))
    return model


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "nmdeploy", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "setup,args,message",
    [
        (
            lambda d: (d / "m.onnx").write_bytes(b"definitely not protobuf"),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx"],
            "not a readable ONNX model",
        ),
        (
            lambda d: (d / "m.onnx").write_bytes(build_mlp().SerializeToString()[:200]),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx"],
            "not a readable ONNX model",
        ),
        (
            lambda d: (
                onnx.save(build_mlp(), d / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0),
                (d / "w.bin").unlink(),
            ),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx"],
            "'w.bin' of tensor",
        ),
        (
            lambda d: onnx.save(build_mlp(), d / "m.onnx"),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx", "--pattern", "2/4"],
            "invalid pattern",
        ),
        (
            lambda d: onnx.save(build_mlp(), d / "m.onnx"),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx", "--include", "nomatch"],
            "nothing to prune",
        ),
        (lambda d: onnx.save(build_mlp(), d / "m.onnx"), ["prune", "{d}/m.onnx", "-o", "{d}/m.onnx"], "--in-place"),
        (lambda d: None, ["inspect", "{d}/missing.onnx"], "no such file"),
        (
            lambda d: onnx.save(with_bad_value(build_mlp(), np.nan), d / "m.onnx"),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx"],
            "weight 'W1' contains NaN or infinite values",
        ),
        (
            lambda d: onnx.save(with_bad_value(build_mlp(), np.inf), d / "m.onnx"),
            ["prune", "{d}/m.onnx", "-o", "{d}/o.onnx"],
            "weight 'W1' contains NaN or infinite values",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(tmp_path, setup, args, message):
    setup(tmp_path)
    before = {p.name: digest(p) for p in tmp_path.iterdir()}
    result = run_cli(*(a.format(d=tmp_path) for a in args))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
    assert {p.name: digest(p) for p in tmp_path.iterdir()} == before


def test_inspect_require_and_json(tmp_path):
    onnx.save(build_mlp(), tmp_path / "m.onnx")
    assert run_cli("inspect", str(tmp_path / "m.onnx"), "--require").returncode == 1
    assert run_cli("prune", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "p.onnx")).returncode == 0
    result = run_cli("inspect", str(tmp_path / "p.onnx"), "--require", "--json")
    assert result.returncode == 0
    import json

    report = json.loads(result.stdout)
    assert {(w["weight"], w["axis"], w["compliant"]) for w in report["weights"]} == {("W1", 0, 1.0), ("W2", 1, 1.0)}


def test_saving_elsewhere_names_the_data_after_the_output(tmp_path):
    source_dir, out_dir = tmp_path / "in", tmp_path / "out"
    source_dir.mkdir()
    out_dir.mkdir()
    (out_dir / "weights.bin").write_bytes(b"someone else's data")
    onnx.save(build_mlp(), source_dir / "m.onnx", save_as_external_data=True, location="weights.bin", size_threshold=0)
    model = OnnxModel.load(source_dir / "m.onnx")
    prune(model, pattern="2:4")
    model.save(out_dir / "pruned.onnx")
    assert (out_dir / "weights.bin").read_bytes() == b"someone else's data"
    assert sorted(p.name for p in out_dir.iterdir()) == ["pruned.onnx", "pruned.onnx.data", "weights.bin"]
    locations = {
        e.value
        for t in onnx.load(out_dir / "pruned.onnx", load_external_data=False).graph.initializer
        for e in t.external_data
        if e.key == "location"
    }
    assert locations == {"pruned.onnx.data"}
    ort.InferenceSession(str(out_dir / "pruned.onnx")).run(None, {"x": np.ones((2, 16), np.float32)})


@pytest.mark.parametrize("per_channel", [False, True])
def test_integer_weight_behind_dequantize_linear_is_pruned_to_its_zero_point(tmp_path, per_channel):
    rng = np.random.default_rng(4)
    quantized = rng.integers(0, 256, size=(16, 8), dtype=np.uint8)  # MatMul B [K=16, N=8]
    zero = np.full(8, 128, np.uint8) if per_channel else np.array(128, np.uint8)
    scale = rng.uniform(0.01, 0.1, 8).astype(np.float32) if per_channel else np.array(0.05, np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["Wq", "scale", "zero"], ["W"], axis=1),
        helper.make_node("MatMul", ["x", "W"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [
            numpy_helper.from_array(quantized, "Wq"),
            numpy_helper.from_array(scale, "scale"),
            numpy_helper.from_array(zero, "zero"),
        ],
    )
    onnx.save(
        helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", 17)]),
        tmp_path / "q.onnx",
    )
    model = OnnxModel.load(tmp_path / "q.onnx")
    assert prune(model, pattern="2:4").modified
    model.save(tmp_path / "out.onnx")
    pruned = tensor(onnx.load(tmp_path / "out.onnx"), "Wq")
    dequantized = (pruned.astype(np.int32) - zero.astype(np.int32)) * scale
    assert is_nm(torch.from_numpy(dequantized), "2:4", axis=0).fraction == 1.0
    # Kept entries are unchanged and are the two largest dequantized magnitudes of each group.
    original = np.abs((quantized.astype(np.int32) - zero.astype(np.int32)) * scale)
    kept = pruned != zero
    assert np.array_equal(pruned[kept], quantized[kept])
    groups, kept_groups = original.T.reshape(8, 4, 4), kept.T.reshape(8, 4, 4)
    assert (
        np.where(kept_groups, groups, np.inf).min(axis=2) >= np.where(kept_groups, -np.inf, groups).max(axis=2)
    ).all()
    session = ort.InferenceSession(str(tmp_path / "out.onnx"))
    x = np.ones((2, 16), np.float32)
    assert np.allclose(session.run(None, {"x": x})[0], x @ dequantized, atol=1e-5)


def test_inspect_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    onnx.save(build_mlp(), tmp_path / "m.onnx")
    result = run_cli("inspect", str(tmp_path / "m.onnx"), "--plot", str(tmp_path / "layers.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "layers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    bad = run_cli("inspect", str(tmp_path / "m.onnx"), "--plot", str(tmp_path / "layers"))
    assert bad.returncode == 2 and "file extension" in bad.stderr
