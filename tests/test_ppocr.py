"""The PP-OCR networks come out of the rapidocr wheel without installing it: only the pinned wheel is taken, each
file taken out is checked against its pinned hash, and a failed preparation leaves nothing in the cache."""

import hashlib
import zipfile

import pytest

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.reference import ppocr
from nmdeploy.reference.pinned_wheels import extract_checked, prepare_folder, sha256_of


def fake_rapidocr_wheel(folder, files):
    """A wheel named like the pinned one that holds ``files`` (path inside -> bytes): other bytes, so another hash."""
    folder.mkdir(exist_ok=True)
    name = f"rapidocr-{ppocr.WHEEL.version}"
    wheel = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        metadata = f"Metadata-Version: 2.1\nName: rapidocr\nVersion: {ppocr.WHEEL.version}\n"
        archive.writestr(f"{name}.dist-info/METADATA", metadata)
        archive.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        archive.writestr(f"{name}.dist-info/RECORD", "")
    return wheel


def test_prepare_takes_no_wheel_but_the_pinned_one_and_leaves_nothing_behind(tmp_path, capsys):
    fake_rapidocr_wheel(tmp_path / "wheels", {member: b"not the network" for member in ppocr.MEMBERS})
    cache = tmp_path / "cache"
    with pytest.raises(InputError, match="a downloaded wheel does not match its pinned SHA-256"):
        ppocr.prepare(cache, find_links=tmp_path / "wheels")
    assert list(cache.iterdir()) == [] and not ppocr.is_prepared(cache)
    with pytest.raises(MissingDependencyError, match=r"not prepared in .*: run `python -m nmdeploy.reference.ppocr`"):
        ppocr.model_file(ppocr.DETECTOR, cache)
    assert ppocr.main(["--cache", str(cache), "--find-links", str(tmp_path / "wheels")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match its pinned SHA-256" in err
    assert list(cache.iterdir()) == []
    with pytest.raises(InputError, match="not taken from rapidocr"):
        ppocr.model_file("PP-OCRv5_server_det.onnx", cache)


def test_each_file_taken_out_is_checked_against_its_own_hash(tmp_path):
    files = {"pkg/models/a.onnx": b"network a" * 100, "pkg-1.dist-info/licenses/LICENSE": b"licence text"}
    wheel = fake_rapidocr_wheel(tmp_path / "wheels", {**files, "pkg/other.py": b"left out"})
    pins = {member: hashlib.sha256(data).hexdigest() for member, data in files.items()}
    (tmp_path / "out").mkdir()
    extract_checked(wheel, pins, tmp_path / "out", what="the test files")
    assert {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()} == {
        "a.onnx": files["pkg/models/a.onnx"],
        "LICENSE": files["pkg-1.dist-info/licenses/LICENSE"],
    }
    (tmp_path / "other").mkdir()
    with pytest.raises(InputError, match=r"pkg/models/a.onnx of the test files has SHA-256 .*, expected 0{64}"):
        extract_checked(wheel, {**pins, "pkg/models/a.onnx": "0" * 64}, tmp_path / "other", what="the test files")
    with pytest.raises(InputError, match="does not hold the expected files of the test files"):
        extract_checked(wheel, {"pkg/models/b.onnx": "0" * 64}, tmp_path / "other", what="the test files")


def test_a_prepared_folder_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "cache" / "model"
    calls = []

    def failing(staging, scratch):
        (staging / "half.bin").write_bytes(b"half")
        raise InputError("checksum failed")

    with pytest.raises(InputError, match="checksum failed"):
        prepare_folder(target, "weights.bin", failing)
    assert list((tmp_path / "cache").iterdir()) == []

    def filling(staging, scratch):
        calls.append(1)
        (scratch / "download.whl").write_bytes(b"wheel")
        (staging / "weights.bin").write_bytes(b"weights")

    assert prepare_folder(target, "weights.bin", filling) == target
    assert prepare_folder(target, "weights.bin", filling) == target
    assert calls == [1] and [path.name for path in (tmp_path / "cache").iterdir()] == ["model"]
    assert [path.name for path in target.iterdir()] == ["weights.bin"]


@pytest.mark.skipif(not ppocr.is_prepared(), reason=f"the PP-OCR networks are not prepared: run `{ppocr.PREPARE}`")
def test_prepared_files_are_the_pinned_ones():
    for member, expected in ppocr.MEMBERS.items():
        name = member.rsplit("/", 1)[-1]
        assert sha256_of(ppocr.model_file(name)) == expected
