"""`nmdeploy train` on a user's own model and data, named by import paths in the config; export and inspect."""

import json
import textwrap

import onnx
import pytest

from nmdeploy.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = """
import torch
from torch import nn

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 16)
        self.block = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(16, 16)

    def forward(self, tokens):
        return self.lm_head(self.block(self.embed(tokens)))

def make_model():
    return TinyLM()

def not_a_model():
    return 42
"""

DATA = """
import torch

def splits():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (48, 9), generator=generator)
    return tokens[:40, :-1], tokens[:40, 1:], tokens[40:, :-1], tokens[40:, 1:]
"""


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(MODELS)
    (package / "data.py").write_text(DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def config(folder, model="userpkg.models:make_model", data="userpkg.data:splits"):
    path = folder / "user.toml"
    path.write_text(
        textwrap.dedent(f"""
        [task]
        model = "{model}"
        data = "{data}"
        [train]
        epochs = 2
        batch_size = 16
        [sparsity]
        method = "srste"
        backward = ["transposable", "mvue"]
        """)
    )
    return path


def test_train_export_inspect_a_users_language_model(user_package, capsys):
    run_dir = user_package / "run"
    assert main(["train", str(config(user_package)), "-o", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(result["sparsified"]) == [
        "block.linear1",
        "block.linear2",
        "block.self_attn.in_proj_weight",
        "block.self_attn.out_proj",
    ]
    assert list(result["skipped"]) == ["lm_head"]
    assert len(result["epochs"]) == 2 and 0 <= result["epochs"][-1]["test_accuracy"] <= 1
    onnx_path = user_package / "lm.onnx"
    assert main(["export", str(run_dir / "checkpoint.pt"), "-o", str(onnx_path)]) == 0
    assert "PASSED | export: userpkg.models:make_model" in capsys.readouterr().out
    record = json.loads({p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}["nmdeploy.sparsity"])
    assert record["layers"]["lm_head"]["status"] == "dense"
    assert main(["inspect", str(onnx_path), "--require"]) == 0
    capsys.readouterr()
    # The run resumes from its checkpoint with the same config (nothing left to do: it is finished).
    assert (
        main(["train", str(config(user_package)), "-o", str(run_dir), "--resume", str(run_dir / "checkpoint.pt")]) == 0
    )


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ("userpkg.models", "userpkg.data:splits", "must look like 'package.module:function'"),
        ("nosuchpkg.models:make_model", "userpkg.data:splits", "cannot import 'nosuchpkg.models'"),
        ("userpkg.models:missing", "userpkg.data:splits", "has no callable 'missing'"),
        ("userpkg.models:not_a_model", "userpkg.data:splits", "returned int, not a torch nn.Module"),
        ("userpkg.models:make_model", "userpkg.models:make_model", "must return four tensors"),
    ],
)
def test_bad_user_task_is_one_line_and_exit_2(user_package, capsys, model, data, message):
    run_dir = user_package / "bad"
    assert main(["train", str(config(user_package, model, data)), "-o", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (run_dir / "checkpoint.pt").exists()


# -- nmdeploy export of a checkpoint saved from Python: --model names the factory ---------------------------------


@pytest.fixture
def saved_from_python(user_package):
    """A checkpoint of the user's language model trained two steps with the Python API (SR-STE + transposable)."""
    import torch
    from userpkg.data import splits
    from userpkg.models import make_model

    from nmdeploy.train import save_checkpoint, sparsify

    torch.manual_seed(0)
    model = make_model()
    sparsifier = sparsify(model, backward="transposable")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_x, train_y, _, _ = splits()
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(train_x).flatten(0, 1), train_y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sparsifier.step()
    path = save_checkpoint(user_package / "api.pt", model, sparsifier)
    model.eval()
    with torch.no_grad():
        expected = model(train_x[:3]).numpy()
    return path, train_x[:3].numpy(), expected


def test_export_of_a_python_checkpoint_with_model_matches_torch_and_passes_inspect(saved_from_python, capsys):
    import numpy as np
    import onnxruntime

    checkpoint, tokens, expected = saved_from_python
    onnx_path = checkpoint.parent / "api.onnx"
    argv = ["export", str(checkpoint), "-o", str(onnx_path), "--model", "userpkg.models:make_model"]
    assert main([*argv, "--input", "1x8:int64"]) == 0
    assert "PASSED | export: userpkg.models:make_model, 4 layers 2:4" in capsys.readouterr().out
    record = json.loads({p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}["nmdeploy.sparsity"])
    assert record["layers"]["lm_head"]["status"] == "dense"
    assert record["layers"]["block.self_attn.in_proj_weight"]["status"] == "sparse"
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": tokens})  # batch 3 through an export traced at batch 1
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert main(["inspect", str(onnx_path), "--require"]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "saved from Python (save_checkpoint), without a run configuration; name the function"),
        (["--model", "userpkg.models:make_model"], "--model needs the example input(s)"),
        (["--model", "userpkg.models", "--input", "1x8:int64"], "--model 'userpkg.models' must look like"),
        (["--model", "nosuchpkg.models:make_model", "--input", "1x8:int64"], "cannot import 'nosuchpkg.models'"),
        (["--model", "userpkg.models:missing", "--input", "1x8:int64"], "has no callable 'missing'"),
        (["--model", "userpkg.models:not_a_model", "--input", "1x8:int64"], "returned int, not a torch nn.Module"),
        (["--model", "userpkg.models:make_model", "--input", "1xeight"], "give positive sizes joined by 'x'"),
        (["--model", "userpkg.models:make_model", "--input", "1x8:complex"], "unknown dtype 'complex'"),
        (["--model", "userpkg.models:make_model", "--input", "1x8x3:float32"], "fails on inputs of that shape"),
    ],
)
def test_bad_export_model_flags_are_one_line_and_exit_2(saved_from_python, capsys, extra, message):
    checkpoint = saved_from_python[0]
    before = checkpoint.read_bytes()
    onnx_path = checkpoint.parent / "bad.onnx"
    assert main(["export", str(checkpoint), "-o", str(onnx_path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not onnx_path.exists() and checkpoint.read_bytes() == before
    assert sorted(p.name for p in checkpoint.parent.iterdir() if p.name.startswith(".bad")) == []


def test_export_of_a_train_checkpoint_refuses_model(user_package, capsys):
    run_dir = user_package / "run"
    assert main(["train", str(config(user_package)), "-o", str(run_dir)]) == 0
    capsys.readouterr()
    argv = ["export", str(run_dir / "checkpoint.pt"), "-o", str(user_package / "x.onnx")]
    assert main([*argv, "--model", "userpkg.models:make_model", "--input", "1x8:int64"]) == 2
    assert "records its model and inputs; drop --model/--input" in capsys.readouterr().err
