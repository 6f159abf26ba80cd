"""files.py's helpers for writers that take a path: a file is replaced whole or not at all, an exporter's model and
data files arrive in one commit, and a kill leaves nothing the next write does not clean up."""

import os
import signal
import subprocess
import sys

import pytest

from nmdeploy.files import atomic_output, clean_folder, commit_exported, temporary_folder_beside, write_atomically


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_atomic_output_replaces_the_target_keeping_its_mode_or_leaves_it_when_the_writer_fails(tmp_path):
    target = tmp_path / "report.bin"
    target.write_bytes(b"old")
    target.chmod(0o640)
    with pytest.raises(RuntimeError), atomic_output(target) as temporary:
        temporary.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old" and listing(tmp_path) == ["report.bin"]
    with atomic_output(target) as temporary:
        temporary.write_bytes(b"new")
    assert target.read_bytes() == b"new" and listing(tmp_path) == ["report.bin"]
    assert target.stat().st_mode & 0o777 == 0o640


def test_relative_targets_are_written_beside_themselves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_atomically("report.json", "{}")
    with atomic_output("figure.png", suffix=".png") as temporary:
        temporary.write_bytes(b"png")
    with temporary_folder_beside("model.onnx") as folder:
        (folder / "model.onnx").write_text("model")
        commit_exported(folder, "model.onnx")
    assert listing(tmp_path) == ["figure.png", "model.onnx", "report.json"]


def run_killed(code, point):
    killed = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "NMDEPLOY_KILL_AT": point}, capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()


def test_a_write_killed_at_its_commit_keeps_the_old_file_and_the_next_write_removes_the_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    target.write_text("old")
    run_killed(f"from nmdeploy.files import write_atomically; write_atomically({str(target)!r}, 'new')", "commit")
    assert target.read_text() == "old" and len(listing(tmp_path)) == 2  # the killed writer's temporary
    write_atomically(tmp_path / "other.json", "x")
    assert listing(tmp_path) == ["metrics.json", "other.json"]


EXPORT = """
from pathlib import Path
from nmdeploy.files import commit_exported, temporary_folder_beside
target = Path({target!r})
with temporary_folder_beside(target) as folder:
    (folder / "model.onnx.data").write_text("new data")
    (folder / "model.onnx").write_text("new model")
    commit_exported(folder, target)
"""


def test_an_exported_model_and_its_data_arrive_in_one_commit_even_when_killed_between_the_renames(tmp_path):
    target = tmp_path / "model.onnx"
    target.write_text("old model")
    (tmp_path / "model.onnx.data").write_text("old data")
    run_killed(EXPORT.format(target=str(target)), "rename-1")
    assert (tmp_path / "model.onnx").read_text() == "old model"  # the data file was renamed, the model not yet
    clean_folder(tmp_path)  # what the next command touching the folder does first
    assert listing(tmp_path) == ["model.onnx", "model.onnx.data"]
    assert target.read_text() == "new model" and (tmp_path / "model.onnx.data").read_text() == "new data"


def test_commit_exported_leaves_only_the_exported_files(tmp_path):
    target = tmp_path / "out" / "model.onnx"
    target.parent.mkdir()
    with temporary_folder_beside(target) as folder:
        (folder / "model.onnx").write_text("model")
        (folder / "weights.bin").write_text("data")
        commit_exported(folder, target)
    assert listing(target.parent) == ["model.onnx", "weights.bin"]
