"""The PP-OCR ONNX networks as the ``rapidocr`` wheel ships them, taken out of that wheel without installing it.

The RapidOCR project (Apache-2.0) exports PaddleOCR's networks to ONNX and ships them inside its ``rapidocr``
wheel, whose declared dependencies (OpenCV, Shapely, pyclipper, omegaconf, requests and more, about 210 MB) are an
OCR pipeline nmdeploy never runs. So the wheel is never installed: :func:`prepare`
(``python -m nmdeploy.reference.ppocr``) downloads rapidocr 3.10.0 alone (:mod:`nmdeploy.reference.pinned_wheels`:
``pip download --no-deps``, binary only, the wheel checked against its pinned SHA-256), copies out the three ONNX
files and the two licence files, checks each against its own pinned SHA-256, and leaves them in the cache folder
in one rename (about 32 MB). :mod:`nmdeploy.reference.textdet` and :mod:`nmdeploy.reference.textcls` read them
from there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from nmdeploy.errors import InputError
from nmdeploy.reference.pinned_wheels import (
    PinnedWheel,
    cache_folder,
    download,
    extract_checked,
    folder_ready,
    prepare_folder,
    prepared_file,
)

WHEEL = PinnedWheel("rapidocr", "3.10.0", "2fc34e26cd0f48514804a94f8832283039c7334076bff60768b1fed9ad068050")
DETECTOR = "PP-OCRv6_det_small.onnx"
CLASSIFIER = "ch_ppocr_mobile_v2.0_cls_mobile.onnx"
RECOGNISER = "PP-OCRv6_rec_small.onnx"
# Each file's path inside the wheel -> its SHA-256; the licences travel with the networks they cover.
MEMBERS = {
    f"rapidocr/models/{DETECTOR}": "090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
    f"rapidocr/models/{CLASSIFIER}": "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
    f"rapidocr/models/{RECOGNISER}": "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
    "rapidocr-3.10.0.dist-info/licenses/LICENSE": "3e0af25fdd06aa9586ae97adb00ea927ebe5a3805ac77d2d3a81ce5f55693333",
    "rapidocr-3.10.0.dist-info/licenses/MODEL_LICENSES.md": (
        "c5fd0e8603d3df743355b546121e6fe0f4ef8ff455c5a85c1681fd3ae520e153"
    ),
}
PREPARE = "python -m nmdeploy.reference.ppocr"
_WHAT = f"the PP-OCR networks of rapidocr {WHEEL.version}"
# The folder appears whole in one rename, so one file tells whether it is there.
_MARKER = DETECTOR


def _folder(cache: str | Path | None) -> Path:
    return Path(cache or cache_folder()) / f"rapidocr-{WHEEL.version}-{WHEEL.sha256[:12]}"


def is_prepared(cache: str | Path | None = None) -> bool:
    """Whether :func:`prepare` has left the networks in ``cache`` (default: the cache folder)."""
    return folder_ready(_folder(cache), _MARKER)


def model_file(name: str, cache: str | Path | None = None) -> Path:
    """The prepared file ``name`` (:data:`DETECTOR`, :data:`CLASSIFIER` or :data:`RECOGNISER`), or a clear error
    saying how to prepare it."""
    if name not in {Path(member).name for member in MEMBERS}:
        raise InputError(f"{name!r} is not taken from rapidocr; choose one of {DETECTOR}, {CLASSIFIER}, {RECOGNISER}")
    prepared_file(_folder(cache), _MARKER, what=_WHAT, command=PREPARE, size="27 MB")
    return _folder(cache) / name


def prepare(cache: str | Path | None = None, *, find_links: str | Path | None = None) -> Path:
    """Download the wheel, check it, take out and check :data:`MEMBERS` into ``cache`` (default: the cache folder)
    unless already there; returns the folder. ``find_links``: a folder to take the wheel from
    instead of the registry."""

    def fill(staging: Path, scratch: Path) -> None:
        (wheel,) = download([WHEEL], scratch, what=f"rapidocr {WHEEL.version}", find_links=find_links)
        extract_checked(wheel, MEMBERS, staging, what=_WHAT)

    return prepare_folder(_folder(cache), _MARKER, fill)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nmdeploy.reference.ppocr [--cache FOLDER] [--find-links FOLDER]``: prepare the networks."""
    parser = argparse.ArgumentParser(
        prog=PREPARE, description="Download rapidocr's wheel (27 MB), check it and keep its PP-OCR ONNX networks."
    )
    parser.add_argument("--cache", help="where to keep them (default: $NMDEPLOY_CACHE, else ~/.cache/nmdeploy)")
    parser.add_argument("--find-links", metavar="FOLDER", help="take the wheel from this folder, offline")
    args = parser.parse_args(argv)
    try:
        print(prepare(args.cache, find_links=args.find_links))
    except InputError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
