"""Writes killed with SIGKILL at every step of their commit: once the next nmdeploy command has touched the folder,
the model is the old version or the new one (never a mix), nothing stray is left, and file modes are kept."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx.external_data_helper import convert_model_to_external_data
from test_onnx_prune import build_mlp

from nmdeploy.cli import main
from nmdeploy.files import private_temporary_folder
from nmdeploy.graph.model import OnnxModel

# Three data files (one per tensor) and the model: four renames in one commit.
KILL_POINTS = ["staged", "journal", "rename-1", "rename-2", "rename-3", "rename-4"]


def write_split_model(folder):
    """A model whose three weights live in three .data files, every file private (0600)."""
    folder.mkdir()
    proto = build_mlp()
    convert_model_to_external_data(proto, all_tensors_to_one_file=False, size_threshold=0)
    onnx.save(proto, folder / "model.onnx")
    for path in folder.iterdir():
        path.chmod(0o600)
    assert len(list(folder.iterdir())) == 4
    return folder / "model.onnx"


def snapshot(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def weights(model_path):
    model = OnnxModel.load(model_path)
    return {t.name: np.array(model.read(t)) for t in model.tensors()}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """The folder before and after an uninterrupted in-place prune."""
    root = tmp_path_factory.mktemp("versions")
    model = write_split_model(root / "done")
    old = snapshot(model.parent)
    old_weights = weights(model)
    assert main(["prune", str(model), "-o", str(model), "--in-place"]) == 0
    new = snapshot(model.parent)
    assert set(new) == set(old) and new != old
    assert all(model.parent.joinpath(name).stat().st_mode & 0o777 == 0o600 for name in new)
    return old, new, old_weights, weights(model)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_in_place_prune_killed_at_each_step_is_old_or_new_after_the_next_command(tmp_path, versions, point):
    old, new, old_weights, new_weights = versions
    model = write_split_model(tmp_path / "m")
    command = [sys.executable, "-m", "nmdeploy", "prune", str(model), "-o", str(model), "--in-place"]
    killed = subprocess.run(command, env={**os.environ, "NMDEPLOY_KILL_AT": point}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert any(name.startswith(".") for name in os.listdir(model.parent))  # it died with work in flight

    assert main(["inspect", str(model)]) in (0, 1)  # the next command touching the folder

    after = snapshot(model.parent)
    assert after in (old, new), f"mixed or stray files after a kill at {point}: {sorted(after)}"
    # Before the journal is complete nothing was switched; from the journal on, the write is rolled forward.
    assert after == (old if point == "staged" else new)
    expected = old_weights if after == old else new_weights
    for name, values in weights(model).items():
        np.testing.assert_array_equal(values, expected[name])
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in model.parent.iterdir())


def test_output_killed_before_its_commit_leaves_no_output_and_no_temporaries(tmp_path, versions):
    model = write_split_model(tmp_path / "m")
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "nmdeploy", "prune", str(model), "-o", str(out / "pruned.onnx")]
    killed = subprocess.run(command, env={**os.environ, "NMDEPLOY_KILL_AT": "staged"}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    assert os.listdir(out)  # temporaries of the killed process
    before = snapshot(model.parent)
    # Any later write into the folder removes them.
    assert main(["prune", str(model), "-o", str(out / "other.onnx")]) == 0
    assert sorted(os.listdir(out)) == ["other.onnx", "other.onnx.1.data", "other.onnx.2.data", "other.onnx.data"]
    assert snapshot(model.parent) == before


def test_private_temporary_folder_of_a_killed_process_is_removed_by_the_next_one(tmp_path):
    script = (
        "import os, signal\n"
        "from nmdeploy.files import private_temporary_folder\n"
        "with private_temporary_folder('calib') as folder:\n"
        "    (folder / 'x.onnx').write_bytes(b'x')\n"
        "    print(folder, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL
    left = killed.stdout.strip()
    assert os.path.isdir(left) and os.stat(left).st_mode & 0o777 == 0o700
    with private_temporary_folder("calib") as folder:
        assert folder.is_dir()
    assert not os.path.exists(left)


def test_a_journal_cannot_rename_files_outside_its_folder(tmp_path):
    """A downloaded folder may carry a forged journal: it is dropped unless it renames nmdeploy temporaries beside
    their targets below the folder."""
    model = write_split_model(tmp_path / "m")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    forged = model.parent / ".nmdeploy-journal-999999999-abcdefgh.json"
    (model.parent / ".x.nmdeploy-999999999-abcdefgh.tmp").write_text("evil")
    forged.write_text(f'{{"renames": [[".x.nmdeploy-999999999-abcdefgh.tmp", "{victim}"], ["W1", "../victim.txt"]]}}')
    before = {k: v for k, v in snapshot(model.parent).items() if not k.startswith(".")}
    OnnxModel.load(model)
    assert victim.read_text() == "keep"
    assert snapshot(model.parent) == before  # journal and its temporary gone, nothing else touched
    shutil.rmtree(model.parent)


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temporaries_go_and_live_ones_stay_when_a_checkpoint_is_saved(tmp_path):
    """Training checkpoints and logs write through the same temporaries: a killed run's are removed by the next
    save into the folder, while a live process's are left to it."""

    from nmdeploy.train.checkpoint import save_checkpoint

    stale = tmp_path / f".checkpoint.pt.nmdeploy-{dead_pid()}-abcd1234.tmp"
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".checkpoint.pt.nmdeploy-{os.getppid()}-abcd1234.tmp"
    live.write_bytes(b"another run's")
    users = tmp_path / ".checkpoint.pt.backup"
    users.write_bytes(b"the user's own")
    save_checkpoint(tmp_path / "checkpoint.pt", torch.nn.Linear(4, 2))
    assert sorted(os.listdir(tmp_path)) == sorted([".checkpoint.pt.backup", live.name, "checkpoint.pt"])


def test_another_hosts_temporaries_stay_until_they_are_a_day_old(tmp_path):
    """On a folder shared between machines a process id says nothing about another host's writer: its temporaries
    are kept while fresh, removed once a day old; this host's dead writers' go at once, old-style names included."""
    from nmdeploy.files import _HOST, write_atomically

    other_host = "0" * 8 if _HOST != "0" * 8 else "1" * 8
    fresh = tmp_path / f".out.txt.nmdeploy-{dead_pid()}-{other_host}-abcd1234.tmp"
    old = tmp_path / f".out.txt.nmdeploy-{dead_pid()}-{other_host}-efgh5678.tmp"
    own = tmp_path / f".out.txt.nmdeploy-{dead_pid()}-{_HOST}-ijkl9012.tmp"
    legacy = tmp_path / f".out.txt.nmdeploy-{dead_pid()}-abcdef12.tmp"
    for path in (fresh, old, own, legacy):
        path.write_text("partial")
    day_and_a_bit = 25 * 3600
    os.utime(old, (old.stat().st_atime - day_and_a_bit, old.stat().st_mtime - day_and_a_bit))
    write_atomically(tmp_path / "out.txt", "done")
    assert sorted(os.listdir(tmp_path)) == sorted([fresh.name, "out.txt"])


def test_a_completed_write_keeps_modes_and_a_new_output_inherits_the_input_mode(tmp_path, versions):
    model = write_split_model(tmp_path / "m")
    model.chmod(0o640)
    assert main(["prune", str(model), "-o", str(model), "--in-place"]) == 0
    assert model.stat().st_mode & 0o777 == 0o640
    assert main(["prune", str(model), "-o", str(tmp_path / "copy.onnx")]) == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.is_file()}
    assert modes == {"copy.onnx": 0o640, "copy.onnx.data": 0o600, "copy.onnx.1.data": 0o600, "copy.onnx.2.data": 0o600}
