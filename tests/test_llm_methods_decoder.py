"""The one-shot methods on the tiny decoder export (tests/decoder_model.py): every block linear 2:4, the tied
embedding left dense, and the methods that fit on the layer's inputs closer to the dense next-token distribution
than magnitude pruning."""

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
        assert main(["compare", str(source), str(out), "--data", str(evaluation), "--metric", "kl", "--json"]) == 0
        (figure,) = json.loads(capsys.readouterr().out)["judged"]
        divergence[method] = figure["details"]["kl"]
    assert max(divergence[m] for m in ("wanda", "sparsegpt", "sparsegpt-refit", "alps")) < divergence["magnitude"]
    assert min(divergence["sparsegpt-refit"], divergence["alps"]) < divergence["wanda"]
