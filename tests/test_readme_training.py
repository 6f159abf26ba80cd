"""docs/python-training.md's training snippets run as written (a user's own model with the plain loop, the two
callbacks)."""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "python-training.md"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def training_snippets() -> list[str]:
    marker = r"<!-- this snippet runs in tests/test_readme_training.py -->\n```python\n(.*?)```"
    return re.findall(marker, PAGE.read_text(), flags=re.S)


def test_readme_training_snippets_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    from nmdeploy.cli import main

    monkeypatch.chdir(tmp_path)
    snippets = training_snippets()
    assert len(snippets) == 3
    namespace: dict = {}
    for snippet in snippets:  # one namespace: later snippets reuse the first one's imports, as a reader would
        exec(compile(snippet, str(PAGE), "exec"), namespace)
    assert "lm_head" in capsys.readouterr().out
    assert namespace["sparsifier"].step_count == 8
    assert list((tmp_path / "runs" / "hf").glob("checkpoint-*/nmdeploy_sparsifier.pt"))
    assert main(["inspect", "char-lm.onnx", "--require"]) == 0
    assert (tmp_path / "char-lm.pt").is_file()
