"""Recurrent layers (ONNX LSTM, GRU, RNN) through inspect, prune, convert and --recover: every verb finds the same
W and R through the one weight query, prunes W along its input axis, and leaves R dense for the one stated reason."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks.arrays import nm_compliance

STEPS, FEATURES = 12, 16


class _Reader(torch.nn.Module):
    """A CRNN-shaped reader: a convolution over time, a bidirectional LSTM, a GRU and a per-step classifier."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(FEATURES, 32, 3, padding=1)
        self.lstm = torch.nn.LSTM(32, 16, bidirectional=True)
        self.gru = torch.nn.GRU(32, 8)
        self.head = torch.nn.Linear(8, 6)

    def forward(self, x):  # x: [batch, features, steps]
        h = torch.relu(self.conv(x)).permute(2, 0, 1)  # [steps, batch, 32]
        h, _ = self.lstm(h)
        h, _ = self.gru(h)
        return self.head(h)


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """The exported reader and calibration / evaluation inputs whose features are correlated, as real ones are."""
    folder = tmp_path_factory.mktemp("recurrent")
    torch.manual_seed(0)
    model = _Reader().eval()
    path = folder / "reader.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.randn(2, FEATURES, STEPS),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}},
        )
    rng = np.random.default_rng(1)
    mixing = rng.standard_normal((FEATURES, 4)).astype(np.float32)

    def inputs(rows):
        latent = rng.standard_normal((rows, 4, STEPS)).astype(np.float32)
        return np.einsum("fk,bks->bfs", mixing, latent) + 0.1 * rng.standard_normal((rows, FEATURES, STEPS)).astype(
            np.float32
        )

    np.savez(folder / "calib.npz", x=inputs(64))
    return path, folder / "calib.npz", inputs(32)


def _weights(path):
    model = OnnxModel.load(path)
    return {weight.name: weight for weight in find_prunable_weights(model.proto, model.index).weights}


def _recurrent(path):
    """{(op, "W" or "R"): weight} of the model's recurrent layers."""
    found = {}
    for weight in _weights(path).values():
        for use in weight.uses:
            if use.op_type in ("LSTM", "GRU", "RNN"):
                found[(use.op_type, "W" if use.input_index == 1 else "R")] = weight
    return found


def _outputs(path, x):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _relative_error(actual, expected):
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def test_the_weight_query_finds_w_and_r_with_their_input_axis(reader):
    path, _, _ = reader
    found = _recurrent(path)
    assert set(found) == {("LSTM", "W"), ("LSTM", "R"), ("GRU", "W"), ("GRU", "R")}
    assert found[("LSTM", "W")].shape == (2, 4 * 16, 32) and found[("LSTM", "R")].shape == (2, 4 * 16, 16)
    assert found[("GRU", "W")].shape == (1, 3 * 8, 32)
    for (op, role), weight in found.items():
        assert weight.axis == 2  # W: the input features; R: the hidden state's
        assert (weight.kept_dense is not None) == (role == "R")
        if role == "R":
            assert op in weight.kept_dense and "hidden state" in weight.kept_dense


def test_inspect_lists_w_and_r_with_tensorrt_s_verdict(reader, capsys):
    path, _, _ = reader
    assert main(["inspect", str(path), "--json"]) == 0
    rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["weights"]}
    found = _recurrent(path)
    for (op, _role), weight in found.items():
        row = rows[weight.name]
        assert row["op_types"] == [op] and row["axis"] == 2
        assert not row["eligible"]
        assert any("loop" in reason and "no sparse tactics" in reason for reason in row["reasons"])
        assert row["dense_on_purpose"] == weight.kept_dense  # None for W, the one reason for R
    assert rows[found[("LSTM", "W")].name]["dense_on_purpose"] is None


def test_prune_and_convert_agree_on_what_they_prune_and_why(reader, tmp_path, capsys):
    path, calibration, evaluation = reader
    found = _recurrent(path)
    original = OnnxModel.load(path)
    pruned, converted = tmp_path / "pruned.onnx", tmp_path / "converted.onnx"
    assert main(["prune", str(path), "-o", str(pruned), "--json"]) == 0
    prune_rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["weights"]}
    assert main(["convert", str(path), "--calib", str(calibration), "-o", str(converted), "--json"]) == 0
    convert_rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["report"] if "weight" in row}
    for (_, role), weight in found.items():
        if role == "R":  # the same reason, word for word, in both; the stored R unchanged by both
            assert prune_rows[weight.name]["skipped"] == convert_rows[weight.name]["skipped"] == weight.kept_dense
        else:
            assert not prune_rows[weight.name].get("skipped") and not convert_rows[weight.name].get("skipped")
        for result in (pruned, converted):
            model = OnnxModel.load(result)
            stored = model.read(_weights(result)[weight.name].tensor)
            before = original.read(weight.tensor)
            if role == "R":
                assert np.array_equal(stored, before)
            else:  # 2:4 along the input axis, each direction's gates alike
                assert nm_compliance(stored != 0, "2:4", 2).fraction == 1.0
                assert (stored == 0).mean() == pytest.approx(0.5)
    # The calibrated conversion fits W to the LSTM's and GRU's inputs: the outputs stay closer to the dense model's
    # than magnitude pruning leaves them, on inputs it never saw.
    dense = _outputs(path, evaluation)
    magnitude_error = _relative_error(_outputs(pruned, evaluation), dense)
    calibrated_error = _relative_error(_outputs(converted, evaluation), dense)
    assert calibrated_error < 0.7 * magnitude_error, (calibrated_error, magnitude_error)


def test_recovery_runs_the_recurrent_layers_in_the_interpreter(reader, tmp_path, capsys):
    path, calibration, evaluation = reader
    out = tmp_path / "recovered.onnx"
    assert main(["convert", str(path), "--calib", str(calibration), "--recover", "40", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    (recovery,) = [row for row in report if row.get("step") == "recover"]
    assert recovery["held_out_after"] >= recovery["held_out_before"]
    assert recovery["trained_tensors"] > 0
    found = _recurrent(path)
    model = OnnxModel.load(out)
    weights = _weights(out)
    lstm_w = model.read(weights[found[("LSTM", "W")].name].tensor)
    assert nm_compliance(lstm_w != 0, "2:4", 2).fraction == 1.0  # recovery kept the mask
    np.testing.assert_array_equal(
        model.read(weights[found[("LSTM", "R")].name].tensor), OnnxModel.load(path).read(found[("LSTM", "R")].tensor)
    )
    assert np.isfinite(_outputs(out, evaluation)).all()


def _lstm_in_if(path):
    """y = If(flag) then LSTM(x) (W and R stored in the branch) else x's last hidden-size features."""
    rng = np.random.default_rng(3)
    hidden = 8
    then_graph = helper.make_graph(
        [
            helper.make_node("LSTM", ["x", "W", "R"], ["seq", "then_out"], hidden_size=hidden, name="branch_lstm"),
        ],
        "then",
        [],
        [helper.make_empty_tensor_value_info("then_out")],
        [
            numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, 16)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32), "R"),
        ],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["else_out"])],
        "else",
        [],
        [helper.make_empty_tensor_value_info("else_out")],
        [
            numpy_helper.from_array(np.array([0, 8], np.int64), "starts"),
            numpy_helper.from_array(np.array([1, 16], np.int64), "ends"),
            numpy_helper.from_array(np.array([0, 2], np.int64), "axes"),
        ],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], then_branch=then_graph, else_branch=else_graph, name="choose")],
        "g",
        [
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 16]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_an_lstm_inside_an_if_is_inspected_and_pruned_like_one_outside(tmp_path, capsys):
    path = _lstm_in_if(tmp_path / "if.onnx")
    assert main(["inspect", str(path), "--json"]) == 0
    rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["weights"]}
    assert set(rows) == {"W", "R"} and rows["W"]["op_types"] == ["LSTM"] and not rows["W"]["eligible"]
    assert rows["R"]["dense_on_purpose"] and "hidden state" in rows["R"]["dense_on_purpose"]
    out = tmp_path / "pruned.onnx"
    assert main(["prune", str(path), "-o", str(out)]) == 0
    capsys.readouterr()
    weights = _weights(out)
    model = OnnxModel.load(out)
    assert nm_compliance(model.read(weights["W"].tensor) != 0, "2:4", 2).fraction == 1.0
    # Convert runs the main graph for its statistics, and W's input exists only inside the branch: it says so.
    assert main(["convert", str(path), "--calib", "random", "-o", str(tmp_path / "c.onnx"), "--json"]) == 2
    error = capsys.readouterr().err
    assert "nothing to convert" in error and "used inside main/choose:then_branch" in error
    assert not (tmp_path / "c.onnx").exists()


def test_an_lstm_cell_s_unsqueezed_2d_weights_are_traced_to_their_input_axis(tmp_path, capsys):
    # torch exports an LSTM cell with W and R stored [4 * hidden, K] and unsqueezed to [1, 4 * hidden, K].
    rng = np.random.default_rng(4)
    stored = [
        numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "W2"),
        numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "R2"),
        numpy_helper.from_array(np.array([0], np.int64), "first"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["W2", "first"], ["W"]),
        helper.make_node("Unsqueeze", ["R2", "first"], ["R"]),
        helper.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=8, name="cell"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        stored,
    )
    path = tmp_path / "cell.onnx"
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    weights = _weights(path)
    assert weights["W2"].axis == 1 and weights["W2"].uses[0].path == ("Unsqueeze",)
    assert weights["R2"].axis == 1 and weights["R2"].kept_dense
    out = tmp_path / "pruned.onnx"
    assert main(["prune", str(path), "-o", str(out)]) == 0
    capsys.readouterr()
    pruned = OnnxModel.load(out)
    assert nm_compliance(pruned.read(_weights(out)["W2"].tensor) != 0, "2:4", 1).fraction == 1.0
    assert np.array_equal(pruned.read(_weights(out)["R2"].tensor), OnnxModel.load(path).read(weights["R2"].tensor))


class _Tagger(torch.nn.Module):
    """A batch-first bidirectional LSTM and two projections wide enough for the fidelity budget to consider."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 32, bidirectional=True, batch_first=True)
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        h, _ = self.lstm(x)
        return self.down(torch.relu(self.up(h)))


def test_the_budget_counts_the_recurrent_weights_with_the_verbs_reasons(tmp_path, capsys):
    torch.manual_seed(0)
    path = tmp_path / "tagger.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Tagger().eval(),
            (torch.randn(2, 6, 16),),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}},
        )
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal((64, 6, 16)).astype(np.float32))
    out = tmp_path / "out.onnx"
    argv = ["convert", str(path), "--calib", str(tmp_path / "calib.npz"), "--min-fidelity", "0.9", "-o", str(out)]
    # The table is what is checked here: auto would judge the random tagger's label sequences, which any converted
    # layer changes, so the budget would rightly convert nothing; spread lets it convert the Gemm.
    assert main([*argv, "--metric", "spread", "--json"]) == 0
    layers = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["budget"]["layers"]}
    found = _recurrent(path)
    w, r = found[("LSTM", "W")], found[("LSTM", "R")]
    # Every weight is in the budget's table with its parameters; the LSTM's with the reasons inspect and convert give.
    assert set(layers) == set(_weights(path))
    assert layers[w.name]["parameters"] == 2 * 4 * 32 * 16 and layers[r.name]["parameters"] == 2 * 4 * 32 * 32
    assert layers[w.name]["reason"].startswith("not eligible: LSTM: TensorRT runs its gate GEMMs in a loop")
    assert layers[r.name]["reason"] == f"not convertible: {r.kept_dense}"
    assert not layers[w.name]["converted"] and not layers[r.name]["converted"]
