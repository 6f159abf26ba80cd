"""A model that declares a free batch axis but runs one row at a time: calibration's probe and compare's batches
find it by one rule, and tell it from data that fails at one row too."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy import InputError
from nmdeploy.calibration.batch_probe import RowRun, run_or_first_row, runs_one_row_only
from nmdeploy.evaluation.compare import compare_models
from nmdeploy.graph.model import OnnxModel
from nmdeploy.runtimes.batch_axes import BatchAxes

RNG = np.random.default_rng(3)


def batch1_model(path, weight):
    """y = reshape(x, [1, 4]) @ W: the batch axis is declared free, but the reshape was traced at batch 1."""
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "traced_shape"], ["row"]),
            helper.make_node("MatMul", ["row", "W"], ["y"]),
        ],
        "batch1",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [
            numpy_helper.from_array(np.array([1, 4], np.int64), "traced_shape"),
            numpy_helper.from_array(weight.astype(np.float32), "W"),
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_rule_runs_the_first_row_alone_only_where_the_batch_fails():
    ran = []

    def one_row_only(feeds):
        ran.append(len(feeds["x"]))
        if len(feeds["x"]) > 1:
            raise InputError("broadcast failed")
        return feeds["x"].sum()

    batch = {"x": np.arange(6.0).reshape(3, 2), "rate": np.array(16000)}
    assert run_or_first_row(one_row_only, batch, BatchAxes({})) == RowRun(1.0, "broadcast failed") and ran == [3, 1]
    assert run_or_first_row(lambda feeds: 7, batch, BatchAxes({})) == RowRun(7)

    def never(feeds):
        raise InputError(f"bad data at {len(feeds['x'])} rows")

    with pytest.raises(InputError, match="at 3 rows"):  # one row fails too: the batch's own error
        run_or_first_row(never, batch, BatchAxes({}))
    with pytest.raises(InputError, match="at 1 rows"):  # nothing to cut: the error as it was
        run_or_first_row(never, {"x": np.zeros((1, 2))}, BatchAxes({}))


def test_calibration_and_compare_find_the_same_batch1_model(tmp_path, caplog):
    weight = RNG.standard_normal((4, 3))
    reference = batch1_model(tmp_path / "ref.onnx", weight)
    candidate = batch1_model(tmp_path / "cand.onnx", weight * np.array([1.0, 1.0, -1.0]))
    rows = RNG.standard_normal((5, 4)).astype(np.float32)

    failure = runs_one_row_only(OnnxModel.load(reference), {"x": rows})
    assert failure is not None and "ONNXRuntimeError" in failure and "\n" not in failure
    assert runs_one_row_only(OnnxModel.load(reference), {"x": rows[:, :3]}) is None  # one row fails too: the data's

    np.savez(tmp_path / "rows.npz", x=rows)
    with caplog.at_level("WARNING"):
        compared = compare_models(reference, candidate, tmp_path / "rows.npz")
    said = [record.getMessage() for record in caplog.records if "row by row" in record.getMessage()]
    assert len(said) == 1 and "comparing row by row" in said[0]
    assert compared.outputs[0].samples == 5
    expected = rows @ weight.astype(np.float32)
    flipped = expected * np.array([1, 1, -1], np.float32)
    cosines = (expected * flipped).sum(axis=1) / np.linalg.norm(expected, axis=1) / np.linalg.norm(flipped, axis=1)
    assert compared.outputs[0].mean_cosine == pytest.approx(cosines.mean(), abs=1e-5)

    np.savez(tmp_path / "narrow.npz", x=rows[:, :3])
    with pytest.raises(InputError):  # fails at one row too: an error, not a row-by-row comparison
        compare_models(reference, candidate, tmp_path / "narrow.npz")


def batched_model(path, weight):
    """y = x @ W at any batch size."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "batched",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(weight.astype(np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_candidate_failing_at_a_batch_the_reference_runs_fails_compare_and_regress(tmp_path, capsys, caplog):
    from nmdeploy.cli import main

    weight = RNG.standard_normal((4, 3))
    reference = batched_model(tmp_path / "ref.onnx", weight)
    candidate = batch1_model(tmp_path / "cand.onnx", weight)  # the same function, one row at a time only
    np.savez(tmp_path / "rows.npz", x=RNG.standard_normal((6, 4)).astype(np.float32))

    with caplog.at_level("WARNING"):
        code = main(
            ["compare", str(reference), str(candidate), "--data", str(tmp_path / "rows.npz"), "--min-fidelity", "0.99"]
        )
    assert code == 1  # the figures agree row by row, yet the candidate cannot run the reference's batches
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"FAILED | the candidate {candidate} fails at batch 6, which the reference runs: ")
    assert "ONNXRuntimeError" in line and "\n" not in line
    said = [record.getMessage() for record in caplog.records if "row by row" in record.getMessage()]
    assert len(said) == 1 and str(candidate) in said[0]

    # regress judges the same comparison: FAILED, and --init writes no baseline of a crashing candidate.
    baselines = tmp_path / "baselines.toml"
    init = ["regress", "--init", str(baselines), "--reference", str(reference), "--candidate", str(candidate)]
    assert main([*init, "--data", str(tmp_path / "rows.npz"), "--batch", "1"]) == 2
    assert "no baselines written: the candidate" in capsys.readouterr().err and not baselines.exists()
    baselines.write_text(
        '[[model]]\nname = "m"\nreference = "ref.onnx"\ncandidate = "cand.onnx"\ndata = "rows.npz"\n'
        "[model.accuracy.y]\nmean_cosine = { baseline = 1.0, tolerance = 0.01 }\n"
    )
    assert main(["regress", str(baselines)]) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"FAILED | 1 of 1 checks regressed: m: the candidate {candidate} fails at batch 6")


def test_a_pair_that_both_run_one_row_at_a_time_is_compared_row_by_row(tmp_path, capsys, caplog):
    from nmdeploy.cli import main

    weight = RNG.standard_normal((4, 3))
    reference, candidate = batch1_model(tmp_path / "ref.onnx", weight), batch1_model(tmp_path / "cand.onnx", weight)
    np.savez(tmp_path / "rows.npz", x=RNG.standard_normal((6, 4)).astype(np.float32))
    with caplog.at_level("WARNING"):
        code = main(
            ["compare", str(reference), str(candidate), "--data", str(tmp_path / "rows.npz"), "--min-fidelity", "0.99"]
        )
    assert code == 0 and capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED | ")
    said = [record.getMessage() for record in caplog.records if "row by row" in record.getMessage()]
    assert said == [
        f"each model (the reference {reference} and the candidate {candidate}) declares a free batch size but runs "
        "only one row at a time (shapes inside it were fixed at export, e.g. traced from a batch-1 example): "
        "comparing row by row"
    ]
