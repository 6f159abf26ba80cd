"""Integer outputs (the labels an ArgMax gives, a detector's kept indices, counts) are judged, by agreement: a
candidate that gives other labels beside unchanged scores fails compare and regress; agreement is corrected for
chance, so a constant answer scores 0 however often the reference gives one value (a detector's padding); where the
models keep different numbers of items, the items they share are counted, never an error."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.evaluation.compare import compare_models
from nmdeploy.fidelity import OutputComparison, fidelity

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CLASSES = 6


def classifier(path, pick="ArgMax"):
    """x [B, 16] -> scores [B, 6] (Softmax) and labels [B] (``pick`` of the logits: ArgMin is the broken head)."""
    weight = np.random.default_rng(3).standard_normal((16, CLASSES)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["logits"], name="head"),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=-1),
        helper.make_node(pick, ["logits"], ["labels"], axis=-1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", CLASSES]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"]),
        ],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


@pytest.fixture
def pair(tmp_path):
    data = tmp_path / "data.npz"
    np.savez(data, x=np.random.default_rng(4).standard_normal((64, 16)).astype(np.float32))
    return classifier(tmp_path / "argmax.onnx"), classifier(tmp_path / "argmin.onnx", "ArgMin"), data


def test_compare_fails_other_labels_beside_unchanged_scores(pair, capsys):
    dense, broken, data = pair
    comparison = compare_models(dense, broken, data)
    assert comparison.selection.judged == ("scores", "labels") and comparison.selection.integer == ("labels",)
    figures = {figure.output: figure for figure in comparison.figures}
    assert figures["scores"].value == pytest.approx(1.0)  # the scores are the dense model's
    assert figures["labels"].metric == "agreement" and figures["labels"].value < 0.1
    assert main(["compare", str(dense), str(broken), "--data", str(data), "--min-fidelity", "0.9"]) == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("FAILED | auto (spread/agreement)")
    assert "'labels' (by agreement)" in out

    assert main(["compare", str(dense), str(dense), "--data", str(data), "--min-fidelity", "0.9"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED")
    # a named measure of the float outputs still judges the labels, by agreement
    for metric in ("spread", "top1"):
        assert main(["compare", str(dense), str(broken), "--data", str(data), "--metric", metric, "--min-fidelity",
                     "0.9"]) == 1, metric  # fmt: skip
        assert f"FAILED | {metric} ({metric}/agreement)" in capsys.readouterr().out


def test_regress_stores_agreement_and_fails_the_broken_labels(pair, tmp_path, capsys):
    dense, broken, data = pair
    baselines = tmp_path / "baselines.toml"
    init = ["regress", "--init", str(baselines), "--reference", str(dense), "--candidate", str(dense)]
    assert main([*init, "--data", str(data), "--batch", "8"]) == 0
    capsys.readouterr()
    entry = tomllib.loads(baselines.read_text())["model"][0]
    assert entry["accuracy"]["labels"] == {"agreement": {"baseline": 1.0, "tolerance": 0.01}}
    assert "mean_cosine" not in entry["accuracy"]["labels"]
    assert main(["regress", str(baselines)]) == 0
    capsys.readouterr()
    baselines.write_text(baselines.read_text().replace('candidate = "argmax.onnx"', 'candidate = "argmin.onnx"'))
    assert tomllib.loads(baselines.read_text())["model"][0]["candidate"] == "argmin.onnx"
    assert main(["regress", str(baselines), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    regressed = [check for check in report["checks"] if check["status"] == "regressed"]
    assert [check["check"] for check in regressed] == ["accuracy labels.agreement"], regressed


def comparison_of(pairs, batch_axis=0):
    output = OutputComparison("labels", batch_axis=batch_axis)
    for reference, candidate in pairs:
        output.add(np.asarray(reference), np.asarray(candidate))
    return output


def test_agreement_is_corrected_for_chance():
    """A detector's label slots, 95 % padding (-1): the constant answer agrees on 95 % of the values, scores 0."""
    rng = np.random.default_rng(0)
    reference = np.where(rng.random((40, 20)) < 0.95, -1, rng.integers(0, 5, (40, 20)))
    constant = comparison_of([(reference, np.full_like(reference, -1))]).agreement_figure()
    assert constant.details["equal_share"] > 0.9 and constant.value == pytest.approx(0.0, abs=1e-12)
    assert constant.chance == 0.0
    same = comparison_of([(reference, reference)]).agreement_figure()
    assert same.value == 1.0
    # one real label in four changed: the plain share says 0.985, kappa 0.86
    changed = reference.copy()
    real = np.flatnonzero(reference.ravel() >= 0)
    changed.ravel()[real[::4]] = (reference.ravel()[real[::4]] + 1) % 5
    figure = comparison_of([(reference, changed)]).agreement_figure()
    assert figure.details["equal_share"] > 0.98 and figure.value < 0.9
    observed, expected = figure.details["equal_share"], figure.details["chance_agreement"]
    assert figure.value == pytest.approx((observed - expected) / (1 - expected))


def test_a_reference_of_one_value_is_judged_by_the_plain_share():
    reference = np.full((10, 4), 7)
    candidate = reference.copy()
    candidate[0, 0] = 3
    figure = comparison_of([(reference, candidate)]).agreement_figure()
    assert figure.value == pytest.approx(39 / 40) and figure.chance is None


def test_different_numbers_of_kept_items_are_compared_as_collections():
    """NonMaxSuppression's [kept, 3] indices: 3 shared of 5 in either model, whatever the order."""
    reference = np.array([[0, 0, 4], [0, 1, 2], [0, 0, 7], [0, 2, 1]])
    candidate = np.array([[0, 0, 7], [0, 0, 4], [0, 1, 2]])
    figure = comparison_of([(reference, candidate)]).agreement_figure()
    assert figure.value == pytest.approx(3 / 4) and figure.details["item_overlap"] == pytest.approx(3 / 4)
    extra = np.array([[0, 0, 7], [0, 0, 4], [0, 1, 2], [0, 3, 3], [0, 2, 1]])
    assert comparison_of([(reference, extra)]).agreement_figure().value == pytest.approx(4 / 5)
    # two axes of different lengths: no items to compare, one clear error
    with pytest.raises(Exception, match="shape \\[2, 5\\] in the candidate but \\[4, 3\\]"):
        comparison_of([(reference, np.zeros((2, 5), np.int64))])


def test_float_against_integer_is_an_error_not_a_figure():
    with pytest.raises(Exception, match="int64 values in the reference but float32 in the candidate"):
        comparison_of([(np.arange(4), np.arange(4, dtype=np.float32))])


def test_fidelity_is_the_lowest_of_scores_and_labels():
    rng = np.random.default_rng(1)
    scores = rng.random((32, CLASSES)).astype(np.float32)
    labels = scores.argmax(axis=1)
    flipped = labels.copy()
    flipped[:8] = (flipped[:8] + 1) % CLASSES
    batches = [({"scores": scores, "labels": labels}, {"scores": scores, "labels": flipped}, {"x": scores})]
    value = fidelity(batches)
    assert 0.6 < value < 0.8  # 24 of 32 labels kept, corrected for chance; the scores alone would say 1


def test_recovery_judges_the_labels_and_trains_toward_the_scores(pair, tmp_path, capsys):
    dense, _, data = pair
    out = tmp_path / "recovered.onnx"
    code = main(["convert", str(dense), "-o", str(out), "--calib", str(data), "--recover", "6", "--json"])
    assert code == 0, capsys.readouterr().err
    document = json.loads(capsys.readouterr().out)
    recovery = next(row for row in document["report"] if row["step"] == "recover")
    assert recovery["outputs"] == ["scores", "labels"]
    assert recovery["metric"] == "spread/agreement"  # the scores by their spread, the labels by agreement
