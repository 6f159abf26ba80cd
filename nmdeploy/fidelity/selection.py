"""Which outputs fidelity figures judge, what each is (its rows, values per row, whether it is a probability map),
and the axis its rows lie along."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nmdeploy.errors import InputError

NEAR_ZERO = 0.05  # a probability below this is background
NEAR_ZERO_SHARE = 0.8  # a probability map with at least this share of background values is judged by its spread


@dataclass(frozen=True)
class OutputSelection:
    """The outputs every fidelity figure judges, and why each other output is left out.

    Exports often return pass-throughs beside what the model computes (sentence-transformers: ``input_ids`` and
    ``attention_mask`` beside the embeddings). Such outputs match perfectly whatever the weights, so averaged in
    they make a damaged model look faithful. Integer outputs (labels, indices, counts) are judged by agreement and
    never trained toward.
    """

    judged: tuple[str, ...]
    left_out: dict[str, str] = field(default_factory=dict)  # output name -> why it is not judged
    # judged outputs that look like detection or segmentation maps -> their share of near-zero values (first batch)
    maps: dict[str, float] = field(default_factory=dict)
    integer: tuple[str, ...] = ()  # judged outputs of integer or boolean values: judged by agreement

    @property
    def trainable(self) -> tuple[str, ...]:
        """The judged float outputs: those a loss can train toward."""
        return tuple(name for name in self.judged if name not in self.integer)

    def describe(self) -> str:
        """One line for reports: the judged outputs, then the others with their reasons, then the probability maps
        (which ``auto`` judges by their spread)."""
        line = (
            "judged output"
            + ("s " if len(self.judged) > 1 else " ")
            + ", ".join(f"'{name}'" + (" (by agreement)" if name in self.integer else "") for name in self.judged)
        )
        if self.left_out:
            line += "; left out: " + ", ".join(f"'{name}' ({why})" for name, why in self.left_out.items())
        if self.maps:
            shares = ", ".join(f"'{name}' ({100 * share:.0f} % below {NEAR_ZERO})" for name, share in self.maps.items())
            line += (
                f"; probability map{'s' if len(self.maps) > 1 else ''} {shares}: --metric auto judges "
                "spread-normalised agreement there (per-sample cosine measures background noise), mask-iou@T the "
                "thresholded masks"
            )
        return line

    def to_json(self) -> dict[str, object]:
        return {
            "judged": list(self.judged),
            "by_agreement": list(self.integer),
            "left_out": dict(self.left_out),
            "probability_maps": dict(self.maps),
        }


def is_float_array(array: np.ndarray) -> bool:
    """Floating point, bfloat16 and float8 (ml_dtypes) included."""
    return np.issubdtype(array.dtype, np.floating) or array.dtype.name.startswith(("bfloat16", "float8"))


def background_share(array: np.ndarray) -> float | None:
    """The share of values below :data:`NEAR_ZERO` where ``array`` is a probability map (values in [0, 1] with
    spatial axes: [batch, ..., H, W]) at least :data:`NEAR_ZERO_SHARE` of whose values are background; else None."""
    array = np.asarray(array)
    if array.ndim < 3 or array.size == 0 or not is_float_array(array):
        return None
    values = array.astype(np.float32, copy=False)
    if values.min() < 0 or values.max() > 1:
        return None
    share = float((values < NEAR_ZERO).mean())
    return share if share >= NEAR_ZERO_SHARE else None


def select_outputs(
    outputs: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    requested: Sequence[str] | None = None,
    *,
    required: bool = True,
) -> OutputSelection:
    """The outputs to judge, decided on one batch: ``requested`` (checked to exist), else every output that is not
    an exact copy of an input (integer outputs too: labels an ArgMax gives, kept detections' indices). Nothing left
    to judge is an InputError that says how to choose, unless not
    ``required`` (a user metric judges instead, on every output)."""
    if requested:
        unknown = [name for name in requested if name not in outputs]
        if unknown:
            raise InputError(
                f"--outputs: the model has no output '{unknown[0]}'; its outputs are "
                + ", ".join(f"'{name}'" for name in outputs)
            )
        chosen = tuple(dict.fromkeys(requested))
        left_out = {name: "not chosen" for name in outputs if name not in chosen}
        return OutputSelection(chosen, left_out, _maps(outputs, chosen), _integer(outputs, chosen))
    judged, left_out = [], {}
    for name, array in outputs.items():
        array = np.asarray(array)
        copied = next(
            (
                feed
                for feed, values in feeds.items()
                if np.shape(values) == array.shape
                and np.asarray(values).dtype == array.dtype
                and np.array_equal(values, array)
            ),
            None,
        )
        if not (is_float_array(array) or np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
            left_out[name] = f"{array.dtype.name}, neither numbers nor truth values"
        elif copied is not None:
            left_out[name] = f"identical to input '{copied}'"
        else:
            judged.append(name)
    if not judged and required:
        reasons = "; ".join(f"'{name}': {why}" for name, why in left_out.items())
        raise InputError(f"no output to judge fidelity on ({reasons}); name the outputs to judge with --outputs")
    return OutputSelection(tuple(judged), left_out, _maps(outputs, judged), _integer(outputs, judged))


def is_integer_array(array: np.ndarray) -> bool:
    """Integer or boolean values: labels, indices, counts, flags, judged by agreement rather than by distance."""
    array = np.asarray(array)
    return np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_


def _integer(outputs: Mapping[str, np.ndarray], judged: Sequence[str]) -> tuple[str, ...]:
    return tuple(name for name in judged if is_integer_array(outputs[name]))


def _maps(outputs: Mapping[str, np.ndarray], judged: Sequence[str]) -> dict[str, float]:
    shares = {name: background_share(outputs[name]) for name in judged}
    return {name: share for name, share in shares.items() if share is not None}


def feed_rows(feeds: Mapping[str, np.ndarray]) -> int | None:
    """The number of rows a batch of ``feeds`` holds: the most common first-axis length of its arrays (scalars and
    inputs whose batch lies elsewhere are outvoted), or None for a batch of scalars."""
    lengths = Counter(np.shape(values)[0] for values in feeds.values() if np.ndim(values) >= 1)
    return lengths.most_common(1)[0][0] if lengths else None


def rows_axis(shape: Sequence[int], rows: int | None) -> int:
    """The axis of an output of ``shape`` its rows lie along, from the data: 0 where its length is the batch's
    ``rows`` (or unknown), else the one axis of that length (a time-major [time, batch, classes] output), else 0."""
    if not shape or rows is None or shape[0] == rows:
        return 0
    matches = [axis for axis, length in enumerate(shape) if length == rows]
    return matches[0] if len(matches) == 1 else 0


def follows_tokens(shape: Sequence[int], axis: int, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether an output has one position per token of an integer input: [rows, positions, ...] against a
    [rows, positions] token input (a language model's logits)."""
    if axis != 0 or len(shape) < 3:
        return False
    return any(
        np.issubdtype(np.asarray(value).dtype, np.integer) and np.shape(value) == tuple(shape[:2])
        for value in feeds.values()
    )
