"""Text -> token shards for a model's inputs, through a Hugging Face ``tokenizers`` tokenizer.

Sentences: paragraphs are separated by blank lines, and line breaks inside a paragraph are spaces; a sentence ends
at ``.``, ``!`` or ``?`` (with any closing quotes or brackets after it) followed by white space, and the rest of a
paragraph is its last sentence. Abbreviations such as "e.g. " end a sentence too: the rule is simple on purpose.

Model inputs are matched to the tokenizer's outputs by name: token ids, attention mask, token type ids, position
ids. Each shard is padded to its longest sentence (at most ``max_length`` tokens), or to the model's fixed sequence
length.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.imports import require
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.data import graph_inputs, index_bounds
from nmdeploy.runtimes.datasets.shards import DataSetReport, check_output_folder, rows_per_shard, write_shards
from nmdeploy.runtimes.prefill import KV_CACHE_NAMES, ROLES, input_role

DEFAULT_MAX_LENGTH = 128
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")  # in order of preference
_SEARCH_DEPTH = 4  # folders below a package's own searched for its tokenizer files
_SEARCH_ENTRIES = 20_000  # folder entries looked at before the search gives up

# Roles in the order they are tried: "token_type_ids" also contains "ids" and "token".
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+")


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` by the module's rule (blank lines end paragraphs; . ! ? and white space end
    sentences)."""
    found = []
    for paragraph in re.split(r"\n[ \t\r\f\v]*\n", text):
        flat = " ".join(paragraph.split())
        start = 0
        for end in _SENTENCE_END.finditer(flat):
            found.append(flat[start : end.end()].strip())
            start = end.end()
        found.append(flat[start:].strip())
    return [sentence for sentence in found if sentence]


def text_files(source: Path) -> list[Path]:
    """A UTF-8 text file, or a folder's .txt files in name order."""
    source = Path(source)
    if source.is_dir():
        files = sorted(path for path in source.glob("*.txt") if path.is_file())
        if not files:
            raise InputError(f"{source}: folder holds no .txt files")
        return files
    if source.is_file():
        return [source]
    raise InputError(f"{source}: no such text file or folder")


def read_text(path: Path) -> str:
    """The text of one UTF-8 file (a byte-order mark dropped)."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text (byte {error.start}); convert it to UTF-8 first") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read it ({error.strerror})") from None


def read_sentences(source: Path) -> list[str]:
    """The sentences of a UTF-8 text file, or of a folder's .txt files in name order."""
    return [sentence for path in text_files(source) for sentence in split_sentences(read_text(path))]


def _tokenizers():
    return require("tokenizers", purpose="nmdeploy data text")


def find_tokenizer_file(spec: str) -> Path:
    """tokenizer.json (or a WordPiece vocab.txt) in the folder ``spec``, or in the folder of the installed package
    named ``spec`` (searched a few levels down)."""
    folder = Path(spec)
    if folder.is_file() and folder.name in TOKENIZER_FILES:
        return folder
    if not folder.is_dir():
        package = _package_folder(spec)
        if package is None:
            raise InputError(
                f"--tokenizer {spec}: no such folder or installed package; give a folder holding tokenizer.json or "
                "vocab.txt, or the name of a package that ships one"
            )
        folder = package
    found = _search(folder)
    if found is None:
        raise InputError(f"--tokenizer {spec}: no tokenizer.json or vocab.txt in {folder} (or a few levels below)")
    return found


def _package_folder(name: str) -> Path | None:
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    try:
        # Only the top-level package's spec is looked up: finding it runs none of its code.
        spec = importlib.util.find_spec(name) if "." not in name else None
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _search(root: Path) -> Path | None:
    """The shallowest tokenizer file below ``root`` (tokenizer.json preferred at equal depth), breadth first and
    bounded in depth and entries, so a package with many files cannot stall it."""
    level, seen = [root], 0
    for _ in range(_SEARCH_DEPTH + 1):
        for wanted in TOKENIZER_FILES:
            for folder in level:
                if (folder / wanted).is_file():
                    return folder / wanted
        below = []
        for folder in level:
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        seen += 1
                        if seen > _SEARCH_ENTRIES:
                            return None
                        if entry.is_dir(follow_symlinks=False) and not entry.name.startswith((".", "__")):
                            below.append(Path(entry.path))
            except OSError:
                continue
        level = sorted(below)
    return None


def default_tokenizer(model: str | Path) -> str:
    """The model's own folder, where exporters write tokenizer.json beside model.onnx (``--tokenizer`` omitted)."""
    folder = Path(model).parent
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"no tokenizer.json or vocab.txt beside {model}; give --tokenizer DIR_OR_PACKAGE")
    return str(folder)


def load_tokenizer(spec: str):
    """A ``tokenizers.Tokenizer`` from ``--tokenizer`` (see :func:`find_tokenizer_file`), with padding switched off
    (shards are padded here)."""
    tokenizers = _tokenizers()
    path = find_tokenizer_file(spec)
    try:
        if path.name == "vocab.txt":
            tokenizer = tokenizers.BertWordPieceTokenizer(str(path), lowercase=_lowercase(path.parent))
        else:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises plain Exceptions for a damaged file
        reason = first_line(error, 200)
        raise InputError(f"{path}: not a readable tokenizer ({reason})") from None
    return tokenizer


def _lowercase(folder: Path) -> bool:
    """An uncased WordPiece vocabulary unless the tokenizer_config.json beside it says otherwise."""
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("do_lower_case", True))
    except (OSError, ValueError, AttributeError):
        return True


def _roles(inputs: Sequence[InputSpec], model: str) -> dict[str, str]:
    roles = {}
    for spec in inputs:
        role = input_role(spec.name)
        if role is None and re.search(KV_CACHE_NAMES, spec.name, re.IGNORECASE):
            raise InputError(
                f"{model}: input '{spec.name}' is a KV cache: a causal language model takes the text packed into "
                "rows, give --seq-len L (and --rows R)"
            )
        if role is None:
            known = "; ".join(f"{role} ({', '.join(words)})" for role, words in ROLES)
            raise InputError(
                f"{model}: input '{spec.name}' matches no tokenizer output; inputs are matched by name: {known}"
            )
        if len(spec.shape) != 2:
            raise InputError(f"{model}: input '{spec.name}' ({spec.describe()}) is not [batch, sequence]")
        roles[spec.name] = role
    return roles


def _sequence_length(inputs: Sequence[InputSpec], max_length: int) -> tuple[int, bool]:
    fixed = {spec.shape[1] for spec in inputs if spec.shape[1] is not None}
    if len(fixed) > 1:
        raise InputError(f"the model's inputs disagree on their sequence length ({sorted(fixed)})")
    return (fixed.pop(), True) if fixed else (max_length, False)


def token_batches(
    encodings: Sequence,
    inputs: Sequence[InputSpec],
    roles: dict[str, str],
    rows: int,
    length: int,
    fixed: bool,
    pad_id: int,
    lengths: list[int],
) -> Iterator[dict[str, np.ndarray]]:
    """Feed dicts of ``rows`` sentences each (whole shards only for a model with a fixed batch size), padded to
    their longest (or to the fixed ``length``); each shard's width is appended to ``lengths``."""
    end = len(encodings) - len(encodings) % rows if _fixed_batch(inputs) else len(encodings)
    for start in range(0, end, rows):
        chunk = encodings[start : start + rows]
        width = length if fixed else max(len(encoding.ids) for encoding in chunk)
        lengths.append(width)
        ids = np.full((len(chunk), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(chunk), width), dtype=np.int64)
        types = np.zeros((len(chunk), width), dtype=np.int64)
        for row, encoding in enumerate(chunk):
            count = len(encoding.ids)
            ids[row, :count] = encoding.ids
            mask[row, :count] = encoding.attention_mask
            types[row, :count] = encoding.type_ids
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), (len(chunk), width))
        by_role = {"token ids": ids, "attention mask": mask, "token type ids": types, "position ids": positions}
        yield {spec.name: by_role[roles[spec.name]].astype(spec.dtype) for spec in inputs}


def _fixed_batch(inputs: Sequence[InputSpec]) -> bool:
    return any(spec.shape[0] is not None for spec in inputs)


def build_text_set(
    model: str | Path,
    source: str | Path,
    tokenizer: str,
    output: str | Path,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    rows: int = 32,
    limit: int | None = None,
) -> DataSetReport:
    """Tokenise the sentences of ``source`` for ``model``'s inputs and write them as shards into ``output`` (a causal
    language model's text packed into rows instead: :mod:`nmdeploy.runtimes.datasets.packed`)."""
    from nmdeploy.graph.model import OnnxModel

    if max_length < 1:
        raise InputError(f"--max-length must be at least 1, got {max_length}")
    if limit is not None and limit < 1:
        raise InputError(f"--limit must be at least 1, got {limit}")
    check_output_folder(Path(output), [Path(source), Path(model)])
    proto = OnnxModel.load(model).proto
    inputs = graph_inputs(proto)
    roles = _roles(inputs, str(model))
    length, fixed = _sequence_length(inputs, max_length)
    per_shard = rows_per_shard(inputs, rows)
    sentences = read_sentences(Path(source))[:limit]
    if not sentences:
        raise InputError(f"{source}: holds no sentences; give UTF-8 text with at least one")
    if _fixed_batch(inputs) and len(sentences) < per_shard:
        raise InputError(f"{model} takes batches of {per_shard} rows; {source} holds only {len(sentences)} sentences")
    tokenize = load_tokenizer(tokenizer)
    padding = tokenize.padding or {}  # the tokenizer's own pad id, read before its padding is turned off
    tokenize.no_padding()
    tokenize.enable_truncation(length)
    encodings = tokenize.encode_batch(sentences)
    _check_ids(encodings, inputs, roles, index_bounds(proto, inputs), length, fixed, tokenizer)
    pad_id = padding.get("pad_id")
    if pad_id is None:
        pad_id = next((i for t in ("[PAD]", "<pad>") if (i := tokenize.token_to_id(t)) is not None), 0)
    lengths: list[int] = []
    batches = token_batches(encodings, inputs, roles, per_shard, length, fixed, pad_id, lengths)
    report = write_shards(Path(output), str(source), inputs, batches, per_shard)
    report.sequence_lengths = [min(lengths), max(lengths)]
    if _fixed_batch(inputs) and len(encodings) % per_shard:
        report.dropped_rows = len(encodings) % per_shard
    return report


def _check_ids(encodings, inputs, roles, bounds: dict[str, int], length: int, fixed: bool, tokenizer: str) -> None:
    """Every id must be a row of the table its input indexes: a larger id means the tokenizer is not the model's."""
    largest = max((max(encoding.ids, default=0) for encoding in encodings), default=0)
    longest = max((len(encoding.ids) for encoding in encodings), default=0)
    for spec in inputs:
        bound = bounds.get(spec.name)
        if bound is None:
            continue
        if roles[spec.name] == "token ids" and largest >= bound:
            raise InputError(
                f"--tokenizer {tokenizer} gives token id {largest}, but input '{spec.name}' indexes a table of "
                f"{bound} rows; is it the model's own tokenizer?"
            )
        if roles[spec.name] == "position ids" and max(longest, length if fixed else 0) > bound:
            raise InputError(f"input '{spec.name}' indexes {bound} positions; give --max-length {bound} or less")
