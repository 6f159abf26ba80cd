"""A malformed TOML file (baselines, recipe, training configuration) is one error line, said once."""

from __future__ import annotations

import pytest

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.pytest_plugin import check_baselines


@pytest.mark.parametrize("verb", ["regress", "run", "train"])
def test_malformed_toml_is_one_line_on_stderr_naming_the_file_once(verb, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("x = 1\ny = = 2\n")
    argv = {
        "regress": ["regress", str(bad)],
        "run": ["run", str(bad), str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx")],
        "train": ["train", str(bad), "-o", str(tmp_path / "run")],
    }[verb]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert captured.err == line + "\n" and line.startswith(f"nmdeploy {verb}: error: {bad}: ")
    assert line.count(str(bad)) == 1 and line.count("line 2, column 5") == 1


def test_the_pytest_plugin_names_a_malformed_baselines_file_once(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[model\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        check_baselines(bad)
    message = str(failure.value)
    assert message.count(str(bad)) == 1 and "\n" not in message
    with pytest.raises(InputError):  # the same error the CLI prints
        from nmdeploy.evaluation.regress import load_baselines

        load_baselines(bad)
