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
