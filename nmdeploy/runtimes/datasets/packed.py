"""Text -> packed token rows for a causal language model (``nmdeploy data text --seq-len L --rows R``).

The text is one token stream: each file in name order, tokenised paragraph by paragraph without special tokens,
the files joined by the tokenizer's end-of-text token where it has one. The stream is cut into rows of exactly
``seq_len`` tokens, so no row is padded and every position is a real next-token prediction; the tail shorter than
a row is left out. SparseGPT (Frantar & Alistarh, 2023) and llm-compressor calibrate on 128 rows of 2048 tokens.

The inputs a decoder export takes are filled for a first pass over each row (a prefill): token ids, an attention
mask of ones, position ids 0..L-1, token type ids of zeros, and every KV-cache input (``past_key_values.*``,
``past_*``) empty: its past-length axis 0, its other axes as the model fixes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.data import graph_inputs, index_bounds
from nmdeploy.runtimes.datasets.shards import DataSetReport, check_output_folder, rows_per_shard, write_shards
from nmdeploy.runtimes.datasets.text import load_tokenizer, read_text, text_files
from nmdeploy.runtimes.prefill import CACHE_ROLE, ROLES, empty_cache_fits, prefill_feed, prefill_role

END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")  # joins files, the first the tokenizer knows
_PARAGRAPHS = re.compile(r".*?(?:\n[ \t\r\f\v]*\n|\Z)", re.DOTALL)
_PARAGRAPHS_PER_CALL = 512  # paragraphs tokenised at a time: the stream stops once it holds enough tokens


def _roles(inputs: Sequence[InputSpec], model: str) -> dict[str, str]:
    roles = {}
    for spec in inputs:
        role = prefill_role(spec)
        if role is None:
            known = "; ".join(f"{role} ({', '.join(words)})" for role, words in ROLES)
            raise InputError(
                f"{model}: input '{spec.name}' matches no decoder input; inputs are matched by name: {known}; "
                f"{CACHE_ROLE} (past, cache)"
            )
        if role == CACHE_ROLE:
            free = sum(size is None for size in spec.shape[1:])
            if not empty_cache_fits(spec):
                raise InputError(
                    f"{model}: KV-cache input '{spec.name}' ({spec.describe()}) has {free or 'no'} free axes besides "
                    "the batch; an empty cache needs exactly one, its past length (export the heads and head size "
                    "fixed)"
                )
        elif len(spec.shape) != 2:
            raise InputError(f"{model}: input '{spec.name}' ({spec.describe()}) is not [batch, sequence]")
        roles[spec.name] = role
    if "token ids" not in roles.values():
        raise InputError(f"{model}: no input takes token ids (an input named like input_ids)")
    return roles


def _check_length(inputs: Sequence[InputSpec], roles: dict[str, str], seq_len: int, model: str) -> None:
    for spec in inputs:
        if roles[spec.name] != CACHE_ROLE and spec.shape[1] is not None and spec.shape[1] != seq_len:
            raise InputError(
                f"{model}: input '{spec.name}' takes exactly {spec.shape[1]} tokens; give --seq-len {spec.shape[1]}"
            )


def token_stream(files: Sequence[Path], tokenizer, wanted: int | None) -> np.ndarray:
    """The files' tokens as one int64 stream (see the module's docstring), stopping once it holds ``wanted``."""
    separator = next((i for token in END_OF_TEXT if (i := tokenizer.token_to_id(token)) is not None), None)
    pieces: list[np.ndarray] = []
    count = 0
    for position, path in enumerate(files):
        if position and separator is not None:
            pieces.append(np.array([separator], np.int64))
            count += 1
        paragraphs = [p for p in _PARAGRAPHS.findall(read_text(path)) if p]
        for start in range(0, len(paragraphs), _PARAGRAPHS_PER_CALL):
            chunk = paragraphs[start : start + _PARAGRAPHS_PER_CALL]
            for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
                pieces.append(np.asarray(encoding.ids, np.int64))
                count += len(encoding.ids)
            if wanted is not None and count >= wanted:
                return np.concatenate(pieces)
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def pack_rows(stream: np.ndarray, seq_len: int, rows: int | None, source: str) -> np.ndarray:
    """[rows, seq_len] cut from the front of ``stream`` (every full row when ``rows`` is None)."""
    full = len(stream) // seq_len
    if full == 0 or (rows is not None and full < rows):
        asked = f"--rows {rows} of " if rows is not None else "one row of "
        raise InputError(
            f"{source}: {len(stream)} tokens make {full} rows of {seq_len}; {asked}--seq-len {seq_len} needs "
            f"{(rows or 1) * seq_len}: give more text, or fewer --rows or a shorter --seq-len"
        )
    count = full if rows is None else rows
    return stream[: count * seq_len].reshape(count, seq_len)


def prefill_batches(
    ids: np.ndarray, inputs: Sequence[InputSpec], roles: dict[str, str], per_shard: int
) -> Iterator[dict[str, np.ndarray]]:
    """Feed dicts of ``per_shard`` packed rows each, every input filled for a first pass (an empty KV cache)."""
    end = len(ids) - len(ids) % per_shard if any(spec.shape[0] is not None for spec in inputs) else len(ids)
    for start in range(0, end, per_shard):
        yield prefill_feed(ids[start : start + per_shard], inputs, roles)


def build_packed_set(
    model: str | Path,
    source: str | Path,
    tokenizer: str,
    output: str | Path,
    *,
    seq_len: int,
    rows: int | None = None,
    shard_rows: int = 32,
) -> DataSetReport:
    """Pack the text of ``source`` into ``rows`` rows of ``seq_len`` tokens (every full row when None) for the
    causal language model ``model`` and write them as shards of ``shard_rows`` rows into ``output``."""
    from nmdeploy.graph.model import OnnxModel

    if seq_len < 1:
        raise InputError(f"--seq-len must be at least 1, got {seq_len}")
    if rows is not None and rows < 1:
        raise InputError(f"--rows must be at least 1, got {rows}")
    check_output_folder(Path(output), [Path(source), Path(model)])
    proto = OnnxModel.load(model).proto
    inputs = graph_inputs(proto)
    roles = _roles(inputs, str(model))
    _check_length(inputs, roles, seq_len, str(model))
    per_shard = rows_per_shard(inputs, shard_rows)
    files = text_files(Path(source))
    tokenize = load_tokenizer(tokenizer)
    stream = token_stream(files, tokenize, None if rows is None else rows * seq_len)
    ids = pack_rows(stream, seq_len, rows, str(source))
    bounds = index_bounds(proto, inputs)
    for spec in inputs:
        bound = bounds.get(spec.name)
        if roles[spec.name] == "token ids" and bound is not None and int(ids.max()) >= bound:
            raise InputError(
                f"--tokenizer {tokenizer} gives token id {int(ids.max())}, but input '{spec.name}' indexes a table "
                f"of {bound} rows; is it the model's own tokenizer?"
            )
        if roles[spec.name] == "position ids" and bound is not None and seq_len > bound:
            raise InputError(f"input '{spec.name}' indexes {bound} positions; give --seq-len {bound} or less")
    if len(ids) < per_shard and any(spec.shape[0] is not None for spec in inputs):
        raise InputError(f"{model} takes batches of {per_shard} rows; the text makes only {len(ids)} rows")
    report = write_shards(Path(output), str(source), inputs, prefill_batches(ids, inputs, roles, per_shard), per_shard)
    report.sequence_lengths = [seq_len, seq_len]
    if any(spec.shape[0] is not None for spec in inputs) and len(ids) % per_shard:
        report.dropped_rows = len(ids) % per_shard
    return report
