"""Concurrent nmdeploy processes on one folder (real processes): two writers of one output end as one whole version, a
reader during an in-place commit sees the old or the new version, and a writer left as an unreaped zombie does not
pin its temporaries. benchmarks/concurrency.py runs the same trials 100 times (figures in BENCHMARKS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nmdeploy.cli import main
from nmdeploy.files import commit, temporary_beside, write_atomically

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import concurrency  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return concurrency.Setup(tmp_path_factory.mktemp("concurrent"))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(2))
def test_two_writers_of_one_output_leave_one_whole_version(setup, trial):
    assert concurrency.writers_trial(setup, trial) is None


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(2))
def test_a_reader_during_an_in_place_commit_sees_old_or_new(setup, trial):
    failure, saw_new = concurrency.reader_trial(setup, trial)
    assert failure is None


def test_a_zombie_writer_does_not_pin_its_temporaries(setup, tmp_path):
    """A writer killed inside its commit and never reaped keeps its PID (a zombie); the next command still removes
    what it left."""
    out = tmp_path / "model.onnx"
    writer = concurrency.nmdeploy("prune", setup.a, "-o", out, env={"NMDEPLOY_KILL_AT": "staged"})
    stat = Path(f"/proc/{writer.pid}/stat")
    deadline = time.monotonic() + 60
    while stat.read_text().split(") ")[1][0] != "Z":  # not waited for: it stays a zombie
        assert time.monotonic() < deadline
        time.sleep(0.05)
    left = concurrency.leftovers(tmp_path)
    assert left and all(f"-{writer.pid}-" in name for name in left)
    assert main(["prune", str(setup.a), "-o", str(out)]) == 0
    assert concurrency.leftovers(tmp_path) == []
    assert concurrency.fingerprint(out) in setup.expected
    writer.wait()
    assert writer.returncode == -9


def test_the_lock_leaves_no_file_and_dies_with_its_holder(tmp_path):
    """The folder lock is the folder's own descriptor: a holder killed with SIGKILL releases it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; d = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(d, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait()
    began = time.monotonic()
    first, second = temporary_beside(tmp_path / "a"), temporary_beside(tmp_path / "b")
    commit(tmp_path, [(first, tmp_path / "a"), (second, tmp_path / "b")])  # would block while the lock were held
    assert time.monotonic() - began < 5
    write_atomically(tmp_path / "c", "x")
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]
