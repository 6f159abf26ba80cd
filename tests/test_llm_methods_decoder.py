"""The one-shot methods on the tiny decoder export (tests/decoder_model.py): every block linear 2:4, the tied
embedding left dense, each layer fitted toward its own outputs (a language model's default fit target), and the
methods that fit the kept weights closer to the dense next-token distribution than magnitude pruning and Wanda."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import decoder_model as dm  # noqa: E402

from nmdeploy.cli import main  # noqa: E402

pytestmark = pytest.mark.slow  # the export takes seconds on two cores (once per session)


def test_the_one_shot_methods_beat_magnitude_on_held_out_tokens(tmp_path, capsys):
    source = dm.exported("plain")
    calibration, evaluation = tmp_path / "calib.npz", tmp_path / "eval.npz"
    np.savez(calibration, input_ids=dm.token_rows(32, 32, seed=1))
    np.savez(evaluation, input_ids=dm.token_rows(8, 32, seed=2))
    divergence = {}
    for method in ("magnitude", "wanda", "sparsegpt", "sparsegpt-refit", "alps"):
        out = tmp_path / f"{method}.onnx"
        argv = ["convert", str(source), "-o", str(out), "--calib", str(calibration), "--method", method, "--json"]
        assert main(argv) == 0
        report = json.loads(capsys.readouterr().out)["report"]
        converted = [row for row in report if row.get("method")]
        assert len(converted) == 14 and {row["method"] for row in converted} == {method}
        assert [row["node"] for row in report if row.get("skipped")] == ["node_linear_14"]  # the tied lm_head
        summary = next(row for row in report if row.get("step") == "summary")
        assert summary.get("fit_target") == (None if method == "magnitude" else "layer")
        assert main(["compare", str(source), str(out), "--data", str(evaluation), "--metric", "kl", "--json"]) == 0
        (figure,) = json.loads(capsys.readouterr().out)["judged"]
        divergence[method] = figure["details"]["kl"]
    # Wanda keeps the weights as they are: on random weights and random tokens its input norms carry little, and it
    # lands beside magnitude (KL 0.0645 against 0.0636 measured); the methods that fit the kept weights do not.
    fitted = ("sparsegpt", "sparsegpt-refit", "alps")
    assert max(divergence[m] for m in fitted) < min(divergence["magnitude"], divergence["wanda"])
    assert min(divergence["sparsegpt-refit"], divergence["alps"]) < divergence["sparsegpt"]
