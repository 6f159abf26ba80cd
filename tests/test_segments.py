"""Segment-by-segment statistics equal the statistics of the whole model run at once, whatever crosses the cuts.

The oracle runs the complete model (a copy with the GEMM inputs added as outputs) in ONNX Runtime, with the weights
converted so far and with the dense ones, and forms X~^T X~ and X~^T X in numpy float64.
"""

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from runner_doubles import RecordingRunner

from nmdeploy.calibration.data import calibration_batches
from nmdeploy.calibration.statistics import StageStatistics, collect_statistics, fitting_stages
from nmdeploy.calibration.statistics.segments import SegmentPlan
from nmdeploy.calibration.statistics.taps import as_matrix
from nmdeploy.errors import InputError
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import to_torch
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.runtimes.backends import BACKENDS, Backend, register_backend
from nmdeploy.runtimes.data import graph_inputs

TAPS = {"W1": "x2", "W2": "f1", "W3t": "a2"}


def residual_model(path: Path, external: bool) -> Path:
    """Three stages whose cuts are crossed by a residual stream, a shape tensor and values an If branch reads from
    outer scope; W2 lives in a Constant node and W3t reaches its MatMul through a Transpose."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 16)).astype(np.float32) / 4
    w2 = rng.standard_normal((16, 16)).astype(np.float32) / 4
    # Four outputs from sixteen inputs: W3t's cross moments are collected times the dense weight (X~^T X W^T)
    w3t = rng.standard_normal((4, 16)).astype(np.float32) / 4
    then_branch = helper.make_graph(
        [helper.make_node("Identity", ["res1"], ["then_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, None)],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x2"], ["else_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Reshape", ["x", "sx"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W1"], ["h1"], name="mm1"),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Add", ["r1", "x2"], ["res1"]),
        helper.make_node("Reshape", ["res1", "sx"], ["f1"]),
        helper.make_node("Constant", [], ["W2"], value=numpy_helper.from_array(w2, "W2")),
        helper.make_node("MatMul", ["f1", "W2"], ["h2"], name="mm2"),
        helper.make_node("If", ["cond"], ["g"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Add", ["h2", "g"], ["a2"]),
        helper.make_node("Transpose", ["W3t"], ["W3"], perm=[1, 0]),
        helper.make_node("MatMul", ["a2", "W3"], ["y"], name="mm3"),
    ]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(w1, "W1"),
            numpy_helper.from_array(w3t, "W3t"),
            numpy_helper.from_array(np.array(True), "cond"),
        ],
    )
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save(proto, path, save_as_external_data=True, location=f"{path.name}.data", size_threshold=0)
    else:
        onnx.save(proto, path)
    return path


def calibration(folder: Path, files: int = 3, samples: int = 5) -> Path:
    rng = np.random.default_rng(1)
    folder.mkdir()
    for k in range(files):
        np.savez(folder / f"{k}.npz", x=rng.standard_normal((samples, 4, 16)).astype(np.float32))
    return folder


def tap_values(path: Path, names, folder: Path) -> dict[str, np.ndarray]:
    """The oracle: the whole model in ONNX Runtime with ``names`` as outputs, over every file; rows [N, K]."""
    proto = onnx.load(path)  # external data loaded
    proto.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    values = {name: [] for name in names}
    for file in sorted(folder.glob("*.npz")):
        outputs = session.run(list(names), {"x": np.load(file)["x"]})
        for name, value in zip(names, outputs, strict=True):
            values[name].append(value.reshape(-1, value.shape[-1]).astype(np.float64))
    return {name: np.concatenate(parts) for name, parts in values.items()}


def weights_by_name(model):
    return {w.name: w for w in find_prunable_weights(model.proto).weights}


@pytest.mark.parametrize("external", [False, True])
def test_segment_statistics_equal_whole_model_statistics_as_weights_change(tmp_path, external):
    path = residual_model(tmp_path / "m.onnx", external)
    data = calibration(tmp_path / "calib")
    model = OnnxModel.load(path)
    weights = weights_by_name(model)
    stages = fitting_stages(model, list(weights.values()))
    assert [[w.name for w in stage] for stage in stages] == [["W1"], ["W2"], ["W3t"]]

    dense = tap_values(path, list(TAPS.values()), data)
    dense_matrices = {
        name: as_matrix(w, to_torch(model.read(w.tensor))).double().numpy() for name, w in weights.items()
    }
    batches = calibration_batches(data, graph_inputs(model.proto), max_samples=2)  # 3 files of 5 -> 9 batches
    run = StageStatistics(model, stages, batches, compare_dense=True)
    rng = np.random.default_rng(2)
    for k, (stage, stats, skipped) in enumerate(run):
        assert skipped == {}
        (weight,) = stage
        # The converted stream so far: the model with every earlier stage's weights changed, run whole.
        current = model.save(tmp_path / f"stage{k}.onnx")
        x = tap_values(current, [TAPS[weight.name]], data)[TAPS[weight.name]]
        d = dense[TAPS[weight.name]]
        np.testing.assert_allclose(stats[weight.name].hessian.numpy(), x.T @ x, rtol=1e-5, atol=1e-4)
        assert stats[weight.name].samples == len(x) == 60
        if k == 0:
            assert not stats[weight.name].shifted  # nothing has changed yet
        else:
            assert not np.allclose(x, d)  # the inputs really moved
            stat = stats[weight.name]
            if weight.name == "W3t":  # narrower than half its input: X~^T (X W^T), [K, out]
                assert stat.cross is None and stat.cross_outputs.shape == (16, 4)
                expected = x.T @ (d @ dense_matrices[weight.name].T)
                np.testing.assert_allclose(stat.cross_outputs.numpy(), expected, rtol=1e-5, atol=1e-4)
            else:
                assert stat.cross_outputs is None
                np.testing.assert_allclose(stat.cross.numpy(), x.T @ d, rtol=1e-5, atol=1e-4)
        values = model.read(weight.tensor)
        model.write(weight.tensor, (values * (rng.random(values.shape) > 0.5)).astype(values.dtype))
    assert run.summary.batches == 9 and run.summary.samples == 15 and run.summary.segments == 3
    assert not run.summary.spilled
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("stage")) == sorted(
        ["m.onnx", "calib"] + (["m.onnx.data"] if external else [])
    )


def test_spilled_activations_give_the_same_statistics_and_are_removed(tmp_path, monkeypatch):
    path = residual_model(tmp_path / "m.onnx", external=False)
    data = calibration(tmp_path / "calib")
    spill_root = tmp_path / "spill"
    spill_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill_root))

    def run(cache_limit):
        model = OnnxModel.load(path)
        stages = fitting_stages(model, list(weights_by_name(model).values()))
        batches = calibration_batches(data, graph_inputs(model.proto), max_samples=4)
        stage_statistics = StageStatistics(model, stages, batches, cache_limit=cache_limit)
        result = {}
        for stage, stats, _ in stage_statistics:
            for weight in stage:
                result[weight.name] = stats[weight.name]
                values = model.read(weight.tensor)
                model.write(weight.tensor, np.round(values, 1))
            if stage_statistics.summary.batches and cache_limit == 0:
                assert list(spill_root.iterdir())  # the spill folder exists while the run needs it
        return result, stage_statistics.summary

    in_memory, summary = run(1 << 30)
    spilled, spilled_summary = run(0)
    assert not summary.spilled and spilled_summary.spilled and spilled_summary.spilled_bytes > 0
    for name, stat in in_memory.items():
        np.testing.assert_array_equal(stat.hessian.numpy(), spilled[name].hessian.numpy())
        for moments in ("cross", "cross_outputs"):
            if getattr(stat, moments) is not None:
                np.testing.assert_array_equal(getattr(stat, moments).numpy(), getattr(spilled[name], moments).numpy())
    assert list(spill_root.iterdir()) == []  # removed at the end


def test_segments_read_only_what_crosses_their_cut(tmp_path):
    model = OnnxModel.load(residual_model(tmp_path / "m.onnx", external=False))
    plan = SegmentPlan(model.index, [["x2"], ["f1"], ["a2"]], fed={"W1", "W2", "W3t"})
    first, second, third = plan.segments
    assert first.outputs == ["sx", "x2"] and first.inputs == ["x"]
    assert sorted(second.inputs) == ["sx", "x2"] and second.weights == ["W1"] and "res1" in second.outputs
    assert sorted(third.inputs) == ["f1", "res1", "x2"] and sorted(third.weights) == ["W2"]
    assert sorted(plan.live_after(1)) == ["f1", "res1", "x2"]
    assert {"h1", "a2", "g"} <= plan.tainted and "sx" not in plan.tainted


def test_a_cycle_is_a_clear_error(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"], name="mm"),
        helper.make_node("Add", ["a", "c"], ["b"]),
        helper.make_node("Relu", ["b"], ["c"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cycle",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((8, 8), np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "c.onnx")
    with pytest.raises(InputError, match="cycle"):  # refused where the file is read, before any work
        OnnxModel.load(tmp_path / "c.onnx")
    model = OnnxModel(onnx.load(tmp_path / "c.onnx"), tmp_path)  # a cyclic graph built in memory
    with pytest.raises(InputError, match="cycle"):
        fitting_stages(model, list(weights_by_name(model).values()))


def test_large_arrays_are_split_into_bounded_batches(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 4, 16)).astype(np.float32)
    np.savez_compressed(tmp_path / "big.npz", x=x)
    path = residual_model(tmp_path / "m.onnx", external=False)
    model = OnnxModel.load(path)
    inputs = graph_inputs(model.proto)
    batches = list(calibration_batches(tmp_path / "big.npz", inputs, max_samples=8))
    assert [len(b["x"]) for b in batches] == [8] * 6 + [2]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)
    weights = list(weights_by_name(model).values())
    split, _ = collect_statistics(model, weights, batches)
    whole, _ = collect_statistics(model, weights, [{"x": x}])
    for name in split:
        np.testing.assert_allclose(split[name].hessian.numpy(), whole[name].hessian.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("run_limit", [1, 3 * 4 * 16 * 4 * 3])
def test_batches_run_in_pieces_bounded_by_the_run_limit_give_the_same_statistics(tmp_path, run_limit):
    path = residual_model(tmp_path / "m.onnx", external=False)
    data = calibration(tmp_path / "calib", files=1, samples=12)
    model = OnnxModel.load(path)
    weights = list(weights_by_name(model).values())
    whole = StageStatistics(model, [weights], calibration_batches(data, graph_inputs(model.proto)), run_limit=1 << 30)
    ((_, expected, _),) = list(whole)
    batches = calibration_batches(data, graph_inputs(model.proto))
    pieces = StageStatistics(model, [weights], batches, run_limit=run_limit)
    ((_, stats, _),) = list(pieces)
    # One probe of one sample, then pieces of the limit's size (at least one sample): the three taps of 4 x 16 floats
    # each make 3 * 4 * 16 * 4 bytes a sample, so a limit of three samples' worth runs the other 11 in 4 pieces.
    assert whole.summary.pieces == 2 and whole.summary.batches == pieces.summary.batches == 1
    assert pieces.summary.pieces == (12 if run_limit == 1 else 1 + 4)
    assert pieces.summary.samples == whole.summary.samples == 12
    for name, stat in expected.items():
        np.testing.assert_allclose(stats[name].hessian.numpy(), stat.hessian.numpy(), rtol=1e-5, atol=1e-4)
        assert stats[name].samples == stat.samples == 48


def test_sequential_conversion_equals_fitting_on_whole_model_statistics(tmp_path):
    """The converted weights equal those of the straightforward algorithm: per stage, run the whole converted and
    dense models, form H~ and C, and fit."""
    path = residual_model(tmp_path / "m.onnx", external=True)
    data = calibration(tmp_path / "calib")
    converted = OnnxModel.load(path)
    ConvertPass(calibration=data, batch_size=3)(converted)

    reference = OnnxModel.load(path)
    fitter = ConvertPass(calibration=data)
    dense = tap_values(path, list(TAPS.values()), data)
    for k, stage in enumerate(fitting_stages(reference, list(weights_by_name(reference).values()))):
        current = reference.save(tmp_path / f"reference{k}.onnx")
        for weight in stage:
            x = tap_values(current, [TAPS[weight.name]], data)[TAPS[weight.name]]
            stats, _ = collect_statistics(reference, [weight], [])
            stat = stats[weight.name]
            stat.hessian += torch_from(x.T @ x)
            stat.samples = len(x)
            if k:
                stat.cross = torch_from(x.T @ dense[TAPS[weight.name]])
            fitter._convert(reference, weight, stat)
    for name, weight in weights_by_name(converted).items():
        expected = reference.read(weights_by_name(reference)[name].tensor)
        np.testing.assert_allclose(converted.read(weight.tensor), expected, rtol=1e-4, atol=1e-5)
        assert (converted.read(weight.tensor) == 0).sum() == expected.size // 2


def torch_from(array):
    import torch

    return torch.from_numpy(array)


def test_a_weight_whose_other_operand_is_stored_is_skipped_with_its_reason(tmp_path):
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("MatMul", ["P", "V"], ["p"], name="table"),  # a stored table times a weight
        helper.make_node("Add", ["h", "p"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "stored",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.standard_normal((1, 8)).astype(np.float32), "P"),
            numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "V"),
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    model = OnnxModel.load(tmp_path / "m.onnx")
    weights = [w for w in find_prunable_weights(model.proto).weights if w.name in ("W", "V")]
    stats, skipped = collect_statistics(model, weights, [{"x": rng.standard_normal((4, 8)).astype(np.float32)}])
    assert set(stats) == {"W"} and "'P' is stored" in skipped["V"]


@pytest.fixture
def recording_backend():
    """A backend registered for one test: ONNX Runtime's graph runner, noting every graph it opens and every run, and
    failing on demand."""
    opened, runs, failing = [], [], []

    @register_backend("recording", help="ONNX Runtime on CPU, noting each segment it runs")
    class RecordingBackend(Backend):
        graph_engine = "recording"

        def open_graph(self, graph, fixed=None, **options):
            opened.append(options["label"])
            inner = BACKENDS["ort"].open_graph(graph, fixed, **options)
            return RecordingRunner(inner, options["label"], runs, failing)

    yield opened, runs, failing
    BACKENDS.unregister("recording")


def test_the_engine_runs_its_segments_through_the_backend_registry(tmp_path, recording_backend):
    path = residual_model(tmp_path / "m.onnx", external=False)
    data = calibration(tmp_path / "calib")
    opened, runs, failing = recording_backend

    def statistics(runner):
        model = OnnxModel.load(path)
        stages = fitting_stages(model, list(weights_by_name(model).values()))
        batches = calibration_batches(data, graph_inputs(model.proto), max_samples=5)
        run = StageStatistics(model, stages, batches, runner=runner)
        hessians = {name: stat.hessian.clone() for _, stats, _ in run for name, stat in stats.items()}
        return hessians, run.summary

    expected, _ = statistics("onnxruntime")
    assert not opened and not runs  # the default runner is not the recording one
    hessians, summary = statistics("recording")
    assert opened == [f"the part of the model before calibration stage {k}" for k in range(3)]
    assert len(runs) == summary.segment_runs >= 3 * 3  # every run of every segment went through it
    assert set(hessians) == set(expected) == set(TAPS)
    for name, hessian in expected.items():  # the same engine underneath: the same statistics, to the bit
        np.testing.assert_array_equal(hessians[name].numpy(), hessian.numpy())
    failing.append(True)
    with pytest.raises(
        InputError,
        match="refused the part of the model before calibration stage 0; check the data "
        "against the model's inputs; or use --statistics onnxruntime",
    ):
        statistics("recording")
    with pytest.raises(ValueError, match="statistics runner 'absent': one of onnxruntime, torch, recording"):
        statistics("absent")
