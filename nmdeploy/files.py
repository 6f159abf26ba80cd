"""Safe output: temporaries with a recognisable name, one commit point per write, and cleanup that survives SIGKILL.

Every temporary nmdeploy creates is named ``.<target>.nmdeploy-<pid>-<host>-<random><suffix>`` beside its target
(or ``nmdeploy-<what>-<pid>-<host>-<random>`` for private folders in the system temporary directory), where ``host``
is a short hash of the machine's name. A process killed with SIGKILL cannot clean up after itself, so the next
nmdeploy process that writes into or loads from the folder does it: a temporary whose writer process no longer
exists is removed (:func:`clean_folder`). A process id means nothing on another machine sharing the folder (a
network file system), so another host's temporaries are left alone until they are a day old.

A write of several files (a model and its external data files) commits with one step: every new file is written
under a temporary name, then a journal listing the pending renames is renamed into place, then the renames run and
the journal is removed. A journal left by a killed writer is rolled forward by the next nmdeploy command that touches
the folder, so readers see the old version or the new one, never a mix, and the user's file names stay as they were.

Concurrent nmdeploy processes on one folder: renames alone keep a single file whole, but a commit of several files is
several renames, so a second writer's renames could interleave with the first's and a reader could open the new model
between them with the old data file. A lock is the cheaper fix than a rename discipline (new file names per version,
which users' references to ``model.onnx.data`` forbid): every commit and every roll-forward holds an exclusive
``flock`` on the folder itself, and a model load holds it shared while it reads the model file and opens its data
files, then reads data only through those descriptors. Two writers to one output therefore finish one after the
other (the later one wins whole), and a reader gets the version before or after a commit. The lock is on the folder's
own descriptor, so it leaves no file behind, and the kernel drops it when its holder exits or is killed, so a dead or
zombie writer never blocks anyone; a zombie's temporaries count as abandoned (its PID exists but it has exited).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from nmdeploy.errors import InputError

_TAG = "nmdeploy"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_WRITER = r"(?P<pid>\d+)(-(?P<host>[0-9a-f]{8}))?"  # names written before the host part have none
# tempfile's random part: 8 characters of [a-z0-9_].
_TEMPORARY = re.compile(rf"^\..*\.{_TAG}-{_WRITER}-[a-z0-9_]{{8}}(\.[^/]*)?$")
_JOURNAL = re.compile(rf"^\.{_TAG}-journal-{_WRITER}-[a-z0-9_]{{8}}\.json$")
_PRIVATE_FOLDER = re.compile(rf"^{_TAG}-[a-z]+-{_WRITER}-[a-z0-9_]{{8}}$")
_FOREIGN_AGE_S = 24 * 3600  # another host's temporary older than this is taken as abandoned
_KILL_POINT = "NMDEPLOY_KILL_AT"  # test hook: the process kills itself (SIGKILL) at the named point of a commit
_PAUSE_POINT = "NMDEPLOY_PAUSE_AT"  # test hook: the process sleeps at the named point of a commit


def _process_exists(pid: int) -> bool:
    """Whether a process of this host that can still write runs under ``pid``: an exited one waiting to be reaped
    (a zombie) has closed its files and will never finish its commit."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:
        return False
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (macOS): a zombie's temporaries wait until it is reaped
    return status[status.rfind(")") + 2 : status.rfind(")") + 3] == "Z"


@contextlib.contextmanager
def folder_lock(folder: Path, *, shared: bool) -> Iterator[None]:
    """An advisory lock on ``folder`` itself (flock on its descriptor): exclusive for commits, shared for loads.
    Where the folder cannot be opened or locked (no read permission, a file system without flock) it is skipped:
    the renames alone still keep each file whole."""
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(descriptor, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


class OpenFile:
    """A file opened for reading and closed when the last object holding it is gone (models and their copies share
    one)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self.fd)


def _abandoned(match: re.Match, path: Path) -> bool:
    """Whether the writer that named ``path`` is gone: a dead process of this host, or another host's file that has
    not changed for a day."""
    if match["host"] in (None, _HOST):
        return not _process_exists(int(match["pid"]))
    try:
        return time.time() - path.lstat().st_mtime > _FOREIGN_AGE_S
    except OSError:
        return False


def kill_point(name: str) -> None:
    """Die here with SIGKILL when the test hook names this point: how the tests prove that a commit survives a kill
    at every step. ``NMDEPLOY_PAUSE_AT=NAME:SECONDS`` waits there instead, widening the moment a concurrent reader or
    writer would have to see a half-finished commit."""
    if os.environ.get(_KILL_POINT) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    point, _, seconds = os.environ.get(_PAUSE_POINT, "").partition(":")
    if point == name:
        time.sleep(float(seconds or 0))


def clean_folder(folder: Path) -> None:
    """Finish what killed nmdeploy processes left in ``folder``: roll their committed journals forward, then remove
    their temporaries. Files of live processes, and every file not named as nmdeploy's own, are left alone."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    journals = [name for name in sorted(names) if _JOURNAL.match(name)]
    if journals:
        with folder_lock(Path(folder), shared=False):  # no load or commit sees half of a roll-forward
            for name in journals:
                if Path(folder, name).exists() and _abandoned(_JOURNAL.match(name), Path(folder) / name):
                    _roll_forward(Path(folder), name)
    for name in names:
        match = _TEMPORARY.match(name)
        if match and _abandoned(match, Path(folder) / name):
            path = Path(folder) / name
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()


def _roll_forward(folder: Path, journal_name: str) -> None:
    journal = folder / journal_name
    try:
        renames = json.loads(journal.read_text())["renames"]
    except (OSError, ValueError, KeyError, TypeError):
        renames = []  # unreadable: its temporaries are removed as stale, leaving the old version whole
    for entry in renames if isinstance(renames, list) else []:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(n, str) for n in entry)):
            continue
        temporary, final = (Path(name) for name in entry)
        # A journal only ever renames one of nmdeploy's own temporaries onto a file beside it, below the folder.
        if not _TEMPORARY.match(temporary.name) or temporary.parent != final.parent or not _is_plain_relative(final):
            continue
        source = folder / temporary
        with contextlib.suppress(OSError):
            if stat.S_ISREG(source.lstat().st_mode):
                os.replace(source, folder / final)
    _sync_folder(folder)
    with contextlib.suppress(OSError):
        journal.unlink()


def _is_plain_relative(path: Path) -> bool:
    text = str(path)
    return bool(text) and not path.is_absolute() and ".." not in path.parts and "\0" not in text and path.name != ""


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _default_mode() -> int:
    return 0o666 & ~_umask()


def temporary_beside(target: Path, suffix: str = ".tmp", *, mode: int | None = None) -> Path:
    """An empty temporary file in ``target``'s folder, recognisable as nmdeploy's own so that a later run removes it
    if this process is killed; its mode is ``mode``, else the mode ``target`` has, else the usual default."""
    target = Path(target)
    clean_folder(target.parent)
    prefix = f".{target.name}.{_TAG}-{os.getpid()}-{_HOST}-"
    handle, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=target.parent)
    os.close(handle)
    if mode is None:
        try:
            mode = stat.S_IMODE(target.stat().st_mode)
        except OSError:
            mode = _default_mode()
    os.chmod(name, mode)
    return Path(name)


def commit(folder: Path, renames: Sequence[tuple[Path, Path]]) -> None:
    """Rename every temporary onto its final path (each beside the other, at or below ``folder``) as one step: a
    kill at any moment leaves either none of them renamed or a journal in ``folder`` that the next nmdeploy command
    touching the folder rolls forward."""
    if not renames:
        return
    folder = Path(folder)
    entries = []
    for temporary, final in renames:
        if temporary.parent != final.parent:
            raise ValueError(f"{temporary} is not beside {final}")
        entries.append([str(temporary.relative_to(folder)), str(final.relative_to(folder))])
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
    with folder_lock(folder, shared=False):
        _commit_locked(folder, renames, entries)


def _commit_locked(folder: Path, renames: Sequence[tuple[Path, Path]], entries: list[list[str]]) -> None:
    if len(renames) == 1:
        kill_point("commit")
        os.replace(*renames[0])
        _sync_folder(folder)
        return
    handle, name = tempfile.mkstemp(prefix=f".{_TAG}-journal-{os.getpid()}-{_HOST}-", suffix=".json", dir=folder)
    journal = Path(name)
    with os.fdopen(handle, "w") as stream:
        json.dump({"renames": entries}, stream)
        stream.flush()
        os.fsync(stream.fileno())
    # The journal is complete and on disk before the first rename: that is the commit point. A journal cut short by
    # a kill while it was written does not parse, so it rolls nothing forward and its temporaries go as stale ones.
    _sync_folder(folder)
    kill_point("journal")
    for index, (temporary, final) in enumerate(renames):
        os.replace(temporary, final)
        kill_point(f"rename-{index + 1}")
    for parent in {final.parent for _, final in renames}:
        _sync_folder(parent)
    journal.unlink()


def write_atomically(path: Path, data: str | bytes) -> Path:
    """Write ``data`` (text or bytes) to ``path`` through a temporary file beside it, so no reader sees half of it."""
    path = Path(path)
    check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as temporary:
        if isinstance(data, bytes):
            temporary.write_bytes(data)
        else:
            temporary.write_text(data, encoding="utf-8")
    return path


@contextlib.contextmanager
def atomic_output(target: Path, *, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary file beside ``target`` for writers that take a path (``torch.save``, ``onnx.save``, ``savefig``):
    when the block ends normally it is synced and renamed onto ``target`` (the one commit), when it raises it is
    removed and ``target`` stays as it was. ``suffix`` is for writers that choose a format by the name."""
    target = Path(os.path.abspath(target))  # as the temporary's name is (links are not resolved)
    temporary = temporary_beside(target, suffix)
    try:
        yield temporary
        commit(target.parent, [(temporary, target)])
    finally:
        temporary.unlink(missing_ok=True)


def commit_exported(folder: Path, target: Path) -> None:
    """Move what an exporter wrote into ``folder`` (a :func:`temporary_folder_beside` of ``target``): the model
    ``folder / target.name`` and the external data files beside it, into ``target``'s folder under the same names,
    as one commit with the model renamed last, so a reader never sees a model whose data files are missing."""
    folder, target = Path(folder), Path(os.path.abspath(target))
    written = sorted(path for path in folder.iterdir() if path.name != target.name) + [folder / target.name]
    renames = []
    try:
        for path in written:
            if not path.is_file() or path.is_symlink():
                raise ValueError(f"{path} is not a file an exporter writes beside its model")
            final = target.parent / path.name
            temporary = temporary_beside(final)
            renames.append((temporary, final))
            os.replace(path, temporary)
        commit(target.parent, renames)
    finally:
        for temporary, _ in renames:
            temporary.unlink(missing_ok=True)


def check_input_file(path: str | Path, what: str) -> None:
    """Refuse an input path that is not a regular file, saying which: a folder, something else, or nothing."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not {what}; give the file itself")
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a regular file; give {what}")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: permission denied; this user may not read it")


def same_file(first: Path, second: Path) -> bool:
    """Whether two paths name one file (through symlinks or hard links too)."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return Path(first).resolve() == Path(second).resolve()


def check_output_path(path: str | Path, *, inputs: Sequence[Path] = ()) -> None:
    """Refuse, before any work, an output that cannot be written (a folder, a path under a file, a read-only folder)
    or that is one of the files ``inputs`` names."""
    path = Path(path)
    for used in inputs:
        if same_file(path, used):
            raise InputError(f"{path} is {used}, which the input uses; choose another output path")
    if path.is_dir():
        raise InputError(f"{path} is a folder; give a file path for the output")
    check_writable_parent(path)


def check_writable_parent(path: str | Path) -> None:
    """Refuse an output (file or folder) whose nearest existing ancestor is not a writable folder, where creating
    its missing parents, its temporaries or the final rename would fail."""
    path = Path(path)
    ancestor = path.parent
    while not ancestor.exists():
        if ancestor.is_symlink():  # a dangling link: mkdir would fail
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"cannot write {path}: {ancestor} is not a folder; choose an output path in a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {path}: folder {ancestor} is not writable; choose another output path")


@contextlib.contextmanager
def private_temporary_folder(what: str) -> Iterator[Path]:
    """A folder only this user can read (``nmdeploy-<what>-<pid>-<host>-<random>`` in the system temporary directory),
    removed on exit; one left by a killed process is removed by the next call."""
    root = Path(tempfile.gettempdir())
    _clean_private_folders(root)
    folder = Path(tempfile.mkdtemp(prefix=f"{_TAG}-{what}-{os.getpid()}-{_HOST}-", dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def temporary_folder_beside(target: Path) -> Iterator[Path]:
    """A temporary folder in ``target``'s folder, named like nmdeploy's temporary files (so a later run removes it
    if this process is killed), removed on exit."""
    target = Path(target)
    clean_folder(target.parent)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.{_TAG}-{os.getpid()}-{_HOST}-", dir=target.parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def commit_folder(temporary: Path, final: Path) -> None:
    """Move a finished temporary folder (from :func:`temporary_folder_beside`) onto ``final``, which must be absent
    or empty, in one rename: readers see no folder or the whole one. Its files are synced first."""
    temporary, final = Path(temporary), Path(final)
    for path in sorted(temporary.iterdir()):
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _sync_folder(temporary)
    # mkdtemp makes the folder private (0700); the committed folder gets the mode a new folder usually has.
    os.chmod(temporary, 0o777 & ~_umask())
    kill_point("commit")
    try:
        os.replace(temporary, final)
    except OSError as error:
        raise InputError(f"cannot write {final}: {error.strerror}; give an absent or empty folder") from None
    _sync_folder(final.parent)


def _clean_private_folders(root: Path) -> None:
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        match = _PRIVATE_FOLDER.match(entry.name)
        if not match or not _abandoned(match, Path(entry.path)):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                shutil.rmtree(entry.path, ignore_errors=True)


def load_torch_file(path: Path, what: str) -> object:
    """``torch.load`` of an untrusted file with ``weights_only=True`` always. Failures become one InputError naming
    ``path`` and ``what`` it should be; torch's hint to retry with ``weights_only=False`` never reaches the user,
    because unpickling arbitrary objects from a downloaded file can run code."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch words every refusal "weights only load failed"; only "Unsupported global" means objects it would
        # have to rebuild, anything else (an unknown opcode, a short read) is a damaged file.
        if "unsupported global" in str(error).lower():
            raise InputError(
                f"{path}: not a readable {what}: it holds Python objects other than tensors and plain values, "
                f"which nmdeploy never loads (unpickling them could run code)"
            ) from None
        raise InputError(f"{path}: not a readable {what}; it is damaged or not a torch file") from None
    except Exception:  # torch raises many unrelated types (RuntimeError, EOFError, ...) for a corrupt file
        raise InputError(f"{path}: not a readable {what}; it is damaged, truncated or not a torch file") from None
