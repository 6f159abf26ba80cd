"""Permission errors for real: CI runs as root, for whom every folder is writable, so these cases run the CLI in a
forked child that has dropped to the unprivileged user ``nobody`` (os.setgid/os.setuid). The interpreter and the
verbs' modules are loaded before the fork, since an unprivileged child may not read them where they are installed.
A control case runs the same command into a folder ``nobody`` may write, so the refusals below are not an artefact
of the child. Verbs that start thread pools (ONNX Runtime, torch) are left out: a fork of a process holding them may
hang; they reach the output check through the same files.check_output_path. Without root the cases run as the
current user, for whom the permissions hold anyway."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from test_bad_inputs import folder_state, mlp

import nmdeploy.cli.inspect
import nmdeploy.cli.prune  # noqa: F401  (loaded before the fork)
from nmdeploy.cli import main

NOBODY = 65534


def run_as_nobody(argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of ``main(argv)`` in a child that runs as ``nobody`` (as this user when not root)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.close(read)
            os.dup2(write, 2)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            code = main(argv)
        except BaseException as error:  # a traceback is a failure the parent reports
            import traceback

            sys.stderr.write("Traceback (in the child)\n" + "".join(traceback.format_exception(error)))
        finally:
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 70)
    os.close(write)
    with os.fdopen(read) as stream:
        stderr = stream.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stderr


@pytest.fixture(scope="module", autouse=True)
def warm_imports(tmp_path_factory):
    """Every command once in this process first: the modules the verbs import lazily (rich, parts of the standard
    library) are then loaded when the child forks, wherever the unprivileged user could not read them."""
    scratch = tmp_path_factory.mktemp("warm")
    onnx.save(mlp(), scratch / "model.onnx")
    with (scratch / "calib.npz").open("wb") as handle:
        np.savez(handle, x=np.zeros((2, 16), np.float32))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for verb in COMMANDS.values():
            main([str(a) for a in verb(scratch, scratch / "out.onnx")])
        main(["inspect", str(scratch / "missing.onnx")])
        main(["prune", str(scratch / "model.onnx"), "-o", str(scratch / "model.onnx"), "--in-place"])


@pytest.fixture
def root():
    """A folder every user may enter (pytest's own tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="nmdeploy-permissions-"))
    folder.chmod(0o755)
    model = folder / "model.onnx"
    onnx.save(mlp(), model)
    model.chmod(0o644)
    with (folder / "calib.npz").open("wb") as handle:
        np.savez(handle, x=np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32))
    (folder / "calib.npz").chmod(0o644)
    for name, mode in (("locked", 0o755), ("open", 0o777)):
        (folder / name).mkdir()
        (folder / name).chmod(mode)  # "locked": writable only by its owner, which nobody is not
    yield folder
    shutil.rmtree(folder)


def unwritable_only_when_dropped():
    if os.geteuid() != 0:
        pytest.skip("not root: the folder below is this user's own and writable; the unprivileged case needs root")


COMMANDS = {
    "prune": lambda root, out: ["prune", root / "model.onnx", "-o", out],
    "inspect --plot": lambda root, out: ["inspect", root / "model.onnx", "--plot", out.with_suffix(".png")],
}


@pytest.mark.parametrize("verb", list(COMMANDS))
def test_an_unwritable_output_folder_is_one_line_exit_2_and_nothing_left(root, verb):
    unwritable_only_when_dropped()
    before = folder_state(root)
    code, stderr = run_as_nobody([str(a) for a in COMMANDS[verb](root, root / "locked" / "out.onnx")])
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("[WARNING]")]
    assert code == 2 and len(lines) == 1, stderr
    assert "not writable" in lines[0] and "Traceback" not in stderr
    assert folder_state(root) == before


@pytest.mark.parametrize("verb", list(COMMANDS))
def test_the_same_command_into_a_folder_nobody_may_write_succeeds(root, verb):
    code, stderr = run_as_nobody([str(a) for a in COMMANDS[verb](root, root / "open" / "out.onnx")])
    assert code == 0, stderr
    assert os.listdir(root / "open")


def test_an_in_place_write_in_an_unwritable_folder_changes_nothing(root):
    unwritable_only_when_dropped()
    model = root / "locked" / "model.onnx"
    shutil.copy(root / "model.onnx", model)
    model.chmod(0o666)  # the file itself is writable; replacing it needs the folder
    before = folder_state(root)
    code, stderr = run_as_nobody(["prune", str(model), "-o", str(model), "--in-place"])
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "not writable" in stderr
    assert folder_state(root) == before


def test_an_unreadable_input_is_one_line_exit_2(root):
    unwritable_only_when_dropped()
    (root / "model.onnx").chmod(0o600)
    code, stderr = run_as_nobody(["inspect", str(root / "model.onnx")])
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "permission denied" in stderr
