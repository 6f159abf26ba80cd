"""What each input of a text model takes, found by its name, and the feed of a first pass (a prefill) over token rows.

Tokenizer outputs are matched by words in the input's name (``ROLES``); a decoder's KV-cache inputs
(``past_key_values.0.key``, ``past.1.value``, ...) are fed empty in a prefill: the past-length axis 0, the other axes
as the model fixes them. ``nmdeploy data text`` and seeded random feeds for decoders both fill inputs this way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from nmdeploy.runtimes.base import InputSpec

ROLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("token type ids", ("token_type", "segment", "type_ids")),
    ("attention mask", ("mask",)),
    ("position ids", ("position",)),
    ("token ids", ("ids", "token", "input")),
)
KV_CACHE_NAMES = r"(^|[._/])(past|cache)"  # past_key_values.0.key, past.1.value, ...: a decoder's KV cache
CACHE_ROLE = "KV cache"
_CACHE_NAMES = re.compile(KV_CACHE_NAMES, re.IGNORECASE)


def input_role(name: str) -> str | None:
    """The tokenizer output an input named ``name`` takes (see ROLES), or None."""
    lowered = name.lower()
    return next((role for role, words in ROLES if any(word in lowered for word in words)), None)


def prefill_role(spec: InputSpec) -> str | None:
    """The value a decoder input named ``spec.name`` takes in a prefill: a KV cache, or a tokenizer output."""
    if _CACHE_NAMES.search(spec.name):
        return CACHE_ROLE
    return input_role(spec.name)


def empty_cache_fits(spec: InputSpec) -> bool:
    """Whether a KV-cache input can be fed empty: one free axis besides the batch (the past length)."""
    return len(spec.shape) >= 2 and sum(size is None for size in spec.shape[1:]) == 1


def decoder_roles(inputs: Sequence[InputSpec]) -> dict[str, str] | None:
    """Each input's prefill role when ``inputs`` are a decoder's with a KV cache that can be fed empty (every input
    has a role, one takes token ids, at least one is a cache); None otherwise."""
    roles = {spec.name: prefill_role(spec) for spec in inputs}
    if None in roles.values() or "token ids" not in roles.values() or CACHE_ROLE not in roles.values():
        return None
    for spec in inputs:
        if roles[spec.name] == CACHE_ROLE and not empty_cache_fits(spec):
            return None
        if roles[spec.name] != CACHE_ROLE and len(spec.shape) != 2:
            return None
    return roles  # type: ignore[return-value]


def prefill_feed(ids: np.ndarray, inputs: Sequence[InputSpec], roles: Mapping[str, str]) -> dict[str, np.ndarray]:
    """The feed of a first pass over the token rows ``ids`` [rows, length]: ids, a mask of ones, positions 0..L-1,
    token types of zeros, every KV cache empty."""
    count, length = ids.shape
    by_role = {
        "token ids": ids,
        "attention mask": np.ones((count, length), np.int64),
        "position ids": np.broadcast_to(np.arange(length, dtype=np.int64), (count, length)),
        "token type ids": np.zeros((count, length), np.int64),
    }
    feed = {}
    for spec in inputs:
        if roles[spec.name] == CACHE_ROLE:
            shape = (count, *(0 if size is None else size for size in spec.shape[1:]))
            feed[spec.name] = np.zeros(shape, spec.dtype)
        else:
            feed[spec.name] = np.ascontiguousarray(by_role[roles[spec.name]].astype(spec.dtype))
    return feed
