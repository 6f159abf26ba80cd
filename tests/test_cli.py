"""The command line: version, help, the stats verb on real weights, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest
import torch

from nmdeploy import __version__
from nmdeploy.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nmdeploy", *args], capture_output=True, text=True, timeout=300)


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert __version__ in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "stats" in capsys.readouterr().out


@pytest.fixture
def state_dict_file(tmp_path):
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(8, 16, generator=generator)
    pruned = dense.clone()
    pruned[:, 2::4] = 0
    pruned[:, 3::4] = 0
    path = tmp_path / "weights.pt"
    torch.save(
        {
            "dense.weight": dense,
            "pruned.weight": pruned,
            "dense.bias": torch.zeros(8),
            "odd.weight": torch.randn(6, 10, generator=generator),
            "nan.weight": torch.full((4, 4), float("nan")),
        },
        path,
    )
    return path


def test_stats_json_on_a_state_dict(state_dict_file, capsys):
    assert main(["stats", str(state_dict_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_name = {w["name"]: w for w in report["weights"]}
    # Vectors are not weight matrices; weights that cannot be analysed are listed with the reason.
    assert set(by_name) == {"dense.weight", "pruned.weight", "odd.weight", "nan.weight"}
    assert by_name["pruned.weight"]["compliant"] == 1.0
    assert by_name["pruned.weight"]["retained_nm"] == pytest.approx(1.0)
    assert by_name["dense.weight"]["compliant"] < 1.0
    assert by_name["dense.weight"]["retained_nm"] >= by_name["dense.weight"]["retained_transposable"]
    assert by_name["dense.weight"]["retained_transposable"] >= by_name["dense.weight"]["retained_greedy"]
    assert "multiple of 4" in by_name["odd.weight"]["skipped"]
    assert "NaN" in by_name["nan.weight"]["skipped"]
    assert report["summary"]["weights"] == 2


def test_stats_table_on_the_bundled_model():
    result = run_cli("stats", "--include", r"encoder\.layer\.0\.attention\.self\.query\.weight", "--pattern", "4:8")
    assert result.returncode == 0, result.stderr
    assert "encoder.layer.0.attention.self.query.weight" in result.stdout
    assert "1 weights, 147,456 parameters" in result.stdout


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda tmp: ["stats", str(tmp / "missing.pt")], "no such file"),
        (lambda tmp: ["stats", str(_write(tmp / "junk.pt", b"not a checkpoint"))], "not a readable torch state dict"),
        (lambda tmp: ["stats", str(_write(tmp / "junk.safetensors", b"\x00" * 3))], "not a readable safetensors"),
        (lambda tmp: ["stats", str(_write(tmp / "w.pt", None)), "--include", "("], "invalid --include"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, make_args, message):
    result = run_cli(*make_args(tmp_path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_bad_pattern_is_rejected_by_the_parser(tmp_path):
    result = run_cli("stats", str(_write(tmp_path / "w.pt", None)), "--pattern", "5:4")
    assert result.returncode == 2 and "N must be below M" in result.stderr and "Traceback" not in result.stderr


def _write(path, content):
    if content is None:
        torch.save({"w": torch.ones(4, 4)}, path)
    else:
        path.write_bytes(content)
    return path
