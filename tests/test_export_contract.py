"""The contract between the two halves: a trained checkpoint exports to ONNX with every sparsified layer N:M, as
``nmdeploy inspect --require`` sees it, and the ONNX model computes what the baked torch model computes."""

import json
import re
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from nmdeploy.cli import main
from nmdeploy.train import finalize
from nmdeploy.train.checkpoint import read_checkpoint
from nmdeploy.train.config import config_from_dict
from nmdeploy.train.tasks import build_model
from nmdeploy.train.trainer import train

pytest.importorskip("sklearn")
ort = pytest.importorskip("onnxruntime")

TASKS = ["digits-cnn", "digits-transformer"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def trained_checkpoint(folder, task, **sparsity):
    """Three SR-STE steps: enough for masks and weights to move away from their initial values."""
    data = {
        "task": {"name": task, "train_size": 192},
        "train": {"epochs": 1, "batch_size": 64, "lr": 1e-2},
        "sparsity": {"method": "srste", **sparsity},
    }
    return train(config_from_dict(data), folder, progress=False)


def inspect_json(path, capsys):
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def sparsified_shapes(result):
    """Shape multiset of the sparsified torch weights, in the orientations ONNX may store them."""
    state = read_checkpoint(result.checkpoint)["model"]
    shapes = Counter()
    for name in result.sparsified:
        shape = tuple(state[f"{name}.parametrizations.weight.original"].shape)
        shapes[shape if len(shape) > 2 else tuple(sorted(shape))] += 1
    return shapes


@pytest.mark.parametrize("task", TASKS)
def test_every_sparsified_layer_passes_inspect_require(tmp_path, task, capsys):
    # No dense layers, so every TensorRT-eligible weight was trained N:M and --require must pass as a whole.
    result = trained_checkpoint(tmp_path, task, keep_dense="none")
    onnx_path = tmp_path / "model.onnx"
    assert main(["export", str(result.checkpoint), "-o", str(onnx_path)]) == 0
    assert "PASSED | export" in capsys.readouterr().out
    assert main(["inspect", str(onnx_path), "--require"]) == 0
    capsys.readouterr()
    report = inspect_json(onnx_path, capsys)
    compliant = Counter(
        tuple(w["shape"]) if len(w["shape"]) > 2 else tuple(sorted(w["shape"]))
        for w in report["weights"]
        if w["compliant"] == 1.0 and w["sparsity"] >= 0.5
    )
    assert sparsified_shapes(result) <= compliant  # every sparsified weight is an N:M weight in the ONNX file
    assert all(w["compliant"] == 1.0 for w in report["weights"] if w["eligible"])
    # What stayed dense did so for its shape (the CNN's one-channel stem), and TensorRT could not use it anyway.
    assert all("not a multiple" in reason for reason in result.skipped.values())


@pytest.mark.parametrize("task", TASKS)
def test_dense_on_purpose_layers_are_recorded_and_inspect_require_honours_them(tmp_path, task, capsys):
    result = trained_checkpoint(tmp_path, task)  # the default: output head (and embedding) kept dense
    assert set(result.skipped) and all(
        "keep_dense='auto'" in reason or "not a multiple" in reason for reason in result.skipped.values()
    )
    onnx_path = tmp_path / "model.onnx"
    assert main(["export", str(result.checkpoint), "-o", str(onnx_path), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["sparsified"] == result.sparsified
    report = inspect_json(onnx_path, capsys)
    compliant = Counter(
        tuple(w["shape"]) if len(w["shape"]) > 2 else tuple(sorted(w["shape"]))
        for w in report["weights"]
        if w["compliant"] == 1.0
    )
    assert sparsified_shapes(result) <= compliant
    # The export records which layers are dense and why, and which ONNX initializers hold them.
    proto = onnx.load(str(onnx_path))
    record = json.loads({p.key: p.value for p in proto.metadata_props}["nmdeploy.sparsity"])
    assert {n for n, e in record["layers"].items() if e["status"] == "sparse"} == set(result.sparsified)
    assert {n for n, e in record["layers"].items() if e["status"] == "dense"} == set(result.skipped)
    dense_eligible = [w for w in report["weights"] if w["eligible"] and w["compliant"] != 1.0]
    assert dense_eligible and all(w["dense_on_purpose"] for w in dense_eligible)
    assert main(["inspect", str(onnx_path), "--require"]) == 0
    assert "dense on purpose" in capsys.readouterr().out
    # Without the record the same weights fail --require, unless --allow-dense names them.
    del proto.metadata_props[:]
    stripped = tmp_path / "stripped.onnx"
    onnx.save(proto, str(stripped))
    assert main(["inspect", str(stripped), "--require"]) == 1
    assert "FAILED" in capsys.readouterr().out
    names = "|".join(re.escape(w["weight"]) for w in dense_eligible)
    assert main(["inspect", str(stripped), "--require", "--allow-dense", f"^({names})$"]) == 0
    assert main(["inspect", str(stripped), "--require", "--allow-dense", "("]) == 2
    assert "not a valid regular expression" in capsys.readouterr().err


@pytest.mark.parametrize("task", TASKS)
def test_onnx_model_computes_the_baked_torch_model(tmp_path, task, capsys):
    result = trained_checkpoint(tmp_path, task, backward="mvue")
    onnx_path = tmp_path / "model.onnx"
    assert main(["export", str(result.checkpoint), "-o", str(onnx_path)]) == 0
    payload = read_checkpoint(result.checkpoint)
    config = config_from_dict(payload["config"])
    model, sparsifier = build_model(config.task, config.sparsity, config.train.seed, restore=True)
    model.load_state_dict(payload["model"])
    sparsifier.load_state_dict(payload["sparsifier"])
    images = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # a batch size not seen in export
    with torch.no_grad():
        expected = finalize(model).eval()(images).numpy()
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": images.numpy()})
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5)


def test_export_rejects_a_missing_checkpoint(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.pt"), "-o", str(tmp_path / "m.onnx")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()
