"""The fidelity budget's held-out estimate: a seeded bootstrap lower bound beside the mean, at most the mean,
the same under the same seed, as wide as the rows' spread says, and absent (said so) below the fewest rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_pipeline_user import build_mlp, write_data

from nmdeploy.cli import main
from nmdeploy.conversion.budgeting import (
    MIN_BOUND_ROWS,
    HeldOutEstimate,
    agreement_bound,
    bootstrap_estimate,
    with_agreement_bounds,
)
from nmdeploy.fidelity import Figure, fidelity
from nmdeploy.runtimes.batch_axes import BatchAxes


def noisy_triples(rows: int, seed: int, batches: int = 4):
    """Outputs whose per-row cosine to the reference varies from row to row (noise of a per-row scale)."""
    rng = np.random.default_rng(seed)
    triples = []
    for _ in range(batches):
        dense = rng.standard_normal((rows, 32)).astype(np.float32)
        scale = rng.uniform(0.1, 1.0, (rows, 1)).astype(np.float32)
        candidate = dense + scale * rng.standard_normal((rows, 32)).astype(np.float32)
        triples.append(({"y": dense}, {"y": candidate}, {"x": dense}))
    return triples


def cosine(sample):
    return fidelity(sample, "cosine", ["y"])


def per_row_cosines(triples):
    values = []
    for dense, candidate, _ in triples:
        a, b = dense["y"], candidate["y"]
        values += list((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))
    return np.asarray(values)


def test_the_bound_is_below_the_mean_by_what_the_rows_spread_says_and_is_seeded():
    triples = noisy_triples(50, seed=0)
    axes = BatchAxes({})
    estimate = bootstrap_estimate(triples, cosine, axes, seed=0)
    cosines = per_row_cosines(triples)
    assert estimate.rows == 200 and estimate.mean == pytest.approx(cosines.mean(), abs=1e-6)
    assert estimate.bound < estimate.mean
    # A mean's one-sided 95 % bound is about 1.645 standard errors below it.
    expected_gap = 1.645 * cosines.std(ddof=1) / np.sqrt(len(cosines))
    assert 0.7 * expected_gap < estimate.mean - estimate.bound < 1.3 * expected_gap
    assert bootstrap_estimate(triples, cosine, axes, seed=0) == estimate  # the same seed, the same bound
    other = bootstrap_estimate(triples, cosine, axes, seed=1)
    assert other.bound != estimate.bound and abs(other.bound - estimate.bound) < 0.3 * expected_gap
    wider = bootstrap_estimate(noisy_triples(5, seed=0), cosine, axes, seed=0)  # 20 rows: a wider margin
    assert wider.mean - wider.bound > estimate.mean - estimate.bound


def test_a_perfect_candidate_has_its_bound_at_the_mean_and_few_rows_give_none():
    triples = [({"y": d["y"]}, {"y": d["y"].copy()}, f) for d, _, f in noisy_triples(8, seed=2)]
    exact = bootstrap_estimate(triples, cosine, BatchAxes({}))
    assert exact.bound == pytest.approx(exact.mean, abs=1e-6) and exact.bound <= exact.mean
    few = bootstrap_estimate(noisy_triples(3, seed=0, batches=2), cosine, BatchAxes({}))
    assert few.bound is None and few.judged == few.mean and few.rows == 6
    assert few.note == f"no bound: 6 held-out rows, fewer than {MIN_BOUND_ROWS}"


def test_rows_are_resampled_along_each_values_own_axis():
    """A state output [2, B, H] resampled along axis 1 keeps each row's two layers with its other outputs."""
    rng = np.random.default_rng(0)
    numbers = np.arange(30, dtype=np.float32)
    state = np.stack([numbers, -numbers])[:, :, None].repeat(4, axis=2)
    triple = ({"p": numbers[:, None], "s": state}, {"p": numbers[:, None], "s": state}, {"x": numbers[:, None]})
    seen = []

    def check(sample):
        for dense, _, feeds in sample:
            assert np.array_equal(dense["s"][0, :, 0], dense["p"][:, 0])
            assert np.array_equal(dense["s"][1, :, 0], -feeds["x"][:, 0])
            seen.append(len(np.unique(dense["p"])))
        return float(rng.uniform())

    bootstrap_estimate([triple], check, BatchAxes({"p": 0, "s": 1, "x": 0}), resamples=20)
    assert len(seen) == 21 and min(seen[1:]) < 30  # the first call is the whole set; resamples repeat rows


def test_convert_min_fidelity_reports_and_judges_the_bound(tmp_path, capsys):
    model = build_mlp(tmp_path / "mlp.onnx")
    calib = write_data(tmp_path / "calib.npz", 256, seed=1)
    out = tmp_path / "budget.onnx"
    argv = ["convert", str(model), "-o", str(out), "--calib", str(calib), "--min-fidelity", "0.9"]
    assert main([*argv, "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget["held_out_rows"] >= 40 and budget["bound_confidence"] == 0.95
    assert budget["fidelity_bound"] is not None and 0.9 <= budget["fidelity_bound"] <= budget["fidelity"]
    assert all(a["bound"] <= a["fidelity"] for a in budget["attempts"])
    assert budget["attempts"][-1]["bound"] == budget["fidelity_bound"]
    argv[argv.index(str(out))] = str(tmp_path / "again.onnx")
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"lower 95% bound {budget['fidelity_bound']:.4f} >= 0.9 on {budget['held_out_rows']} rows" in text


def test_too_few_held_out_rows_are_said_and_the_mean_is_judged(tmp_path, capsys):
    model = build_mlp(tmp_path / "mlp.onnx")
    calib = write_data(tmp_path / "calib.npz", 32, seed=1)  # 4 mini-batches of 8 rows: one of them held out
    argv = ["convert", str(model), "-o", str(tmp_path / "out.onnx"), "--calib", str(calib), "--min-fidelity", "0.5"]
    assert main([*argv, "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget["held_out_rows"] == 8 and budget["fidelity_bound"] is None
    assert budget["bound_note"] == f"no bound: 8 held-out rows, fewer than {MIN_BOUND_ROWS}"
    argv[argv.index(str(tmp_path / "out.onnx"))] = str(tmp_path / "again.onnx")
    assert main(argv) == 0
    assert "(no bound: 8 held-out rows, fewer than 10: the figure may overstate" in capsys.readouterr().out


def time_major_triples(batches: int, seed: int):
    """One-row batches whose output is time-major [T, 1, C] while the graph would put its rows on axis 0, as a CTC
    reader's declared [1, T] output does: the output's rows cannot be matched to the inputs'."""
    rng = np.random.default_rng(seed)
    triples = []
    for _ in range(batches):
        dense = rng.standard_normal((20, 1, 16)).astype(np.float32)
        noise = rng.uniform(0.1, 1.0) * rng.standard_normal((20, 1, 16)).astype(np.float32)
        triples.append(({"y": dense}, {"y": dense + noise}, {"x": rng.standard_normal((1, 8)).astype(np.float32)}))
    return triples


def batch_cosine(sample):
    """Mean over batches of each batch's cosine, so that a resample of batches moves it."""
    values = [float((d["y"] * c["y"]).sum() / np.linalg.norm(d["y"]) / np.linalg.norm(c["y"])) for d, c, _ in sample]
    return float(np.mean(values))


def test_unmatched_rows_are_bounded_over_whole_batches():
    axes = BatchAxes({"y": 0, "x": 0})
    triples = time_major_triples(30, seed=0)
    estimate = bootstrap_estimate(triples, batch_cosine, axes, seed=0)
    per_batch = np.asarray([batch_cosine([t]) for t in triples])
    assert estimate.rows == 30 and estimate.mean == pytest.approx(per_batch.mean(), abs=1e-6)
    expected_gap = 1.645 * per_batch.std(ddof=1) / np.sqrt(len(per_batch))
    assert 0.6 * expected_gap < estimate.mean - estimate.bound < 1.4 * expected_gap
    assert "30 held-out batches" in estimate.note
    few = bootstrap_estimate(time_major_triples(6, seed=0), batch_cosine, axes)
    assert few.bound is None and "6 held-out batches are fewer than 10" in few.note


@pytest.mark.parametrize(("agreeing", "rows"), [(10, 10), (9, 10), (56, 64), (1, 5), (950, 1000), (59, 59)])
def test_the_exact_bound_of_agreeing_rows_is_clopper_pearson(agreeing, rows):
    from scipy.stats import beta

    assert agreement_bound(agreeing, rows) == pytest.approx(beta.ppf(0.05, agreeing, rows - agreeing + 1), abs=1e-9)


def test_a_share_of_agreeing_rows_is_bounded_exactly_where_the_bootstrap_sees_no_spread():
    """Every held-out row agrees: each bootstrap resample agrees too (bound 1.0), while 10 of 10 rows only say the
    share is above 0.74 with 95 % confidence; a continuous figure beside it keeps its bootstrap bound."""
    agreeing = Figure("logits", "sequence", 1.0, agreeing=(10, 10))
    bootstrapped = HeldOutEstimate(1.0, 1.0, 10)
    bounded = with_agreement_bounds(bootstrapped, [agreeing])
    assert bounded.bound == pytest.approx(0.05**0.1) and bounded.mean == 1.0
    assert bounded.note == "the exact bound of 10 of 10 rows agreeing"
    cosine = HeldOutEstimate(0.99, 0.98, 200)
    assert with_agreement_bounds(cosine, [Figure("y", "cosine", 0.99)]) == cosine
    assert with_agreement_bounds(cosine, [Figure("y", "sequence", 1.0, agreeing=(200, 200))]) == cosine
    assert with_agreement_bounds(HeldOutEstimate(1.0, None, 6, "no bound"), [agreeing]).bound is None


def nearly_two_of_four(rng):
    """A [64, 64] weight whose every group of 4 along its reduction axis has two values 100 times smaller: its 2:4
    conversion changes few labels."""
    weight = rng.normal(size=(64, 64)) / 8
    small = np.argsort(rng.random((16, 4, 64)), axis=1)[:, :2]
    groups = weight.reshape(16, 4, 64)
    np.put_along_axis(groups, small, np.take_along_axis(groups, small, axis=1) / 100, axis=1)
    return groups.reshape(64, 64).astype(np.float32)


def _two_layer_reader(path, rng):
    """x [batch, time, 64] -> MatMul -> Relu -> MatMul (class scores) -> [batch, time, 32]: label sequences."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="body"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["logits"], name="head"),
        ],
        "reader",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 12, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 12, 32])],
        [
            numpy_helper.from_array(nearly_two_of_four(rng), "w1"),
            numpy_helper.from_array(rng.normal(size=(64, 32)).astype(np.float32), "w2"),
        ],
    )
    import onnx

    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_the_budget_s_bound_on_label_sequences_is_at_most_their_exact_bound(tmp_path, capsys):
    rng = np.random.default_rng(3)
    model = _two_layer_reader(tmp_path / "reader.onnx", rng)
    np.savez(tmp_path / "calib.npz", x=rng.normal(size=(80, 12, 64)).astype(np.float32))
    argv = ["convert", str(model), "-o", str(tmp_path / "out.onnx"), "--calib", str(tmp_path / "calib.npz")]
    code = main([*argv, "--min-fidelity", "0.5", "--json"])
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert code == 0
    agreeing, rows = budget["judged"][0]["rows_agreeing"]
    assert rows == budget["held_out_rows"] == 16
    assert budget["fidelity_bound"] <= agreement_bound(agreeing, rows) + 1e-12
    assert budget["fidelity_bound"] < 0.83  # at most 0.05 ** (1 / 16): 16 rows cannot promise more
