"""One output of a candidate against the reference's, over every compared row: errors, per-row cosine, the
spread-normalised agreement across the batch, top-1 agreement of class scores, thresholded-mask IoU, and for each
figure what a constant output would score on the same data (its chance level), so that a figure the data cannot
move is caught rather than passed.

A per-row cosine ignores scale (a candidate at 0.3x the reference has cosine 1) and is 1 for any row of one value,
so an output with few values per row is judged across the batch: spread agreement 1 - MSE / (2 Var(reference)),
the variance taken across rows for each value position. The constant output that always gives the reference's mean
row scores 0.5 there, whatever the data. Where ``auto`` takes the cosine it also takes the rows' scale agreement
and keeps the lower figure: a key/value cache or box deltas at half their size point the same way and break what
reads them. Per row it is 2s / (1 + s^2) for s the shorter row's length over the longer's (the cosine's
2<r, c> / (|r|^2 + |c|^2) counterpart for length): 1 - d^2 / 2 for a small change d of length, as the cosine is
1 - t^2 / 2 for a small turn t, so the two share one scale; 0.8 at half or twice the length.

Integer outputs (labels, indices, counts, flags) are judged by agreement: the share of equal values corrected for
chance, (p - e) / (1 - e) with e the agreement of two independent draws from the two models' value frequencies
(Cohen's kappa), so that a constant answer scores 0 however often the reference gives one value (a detector's
padding). A reference that gives a single value is judged by the plain share. Where the models give different
numbers of items (the boxes a detector keeps), the items along the one axis whose length differs are compared as
collections: the shared items over all items.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.fidelity.selection import NEAR_ZERO, NEAR_ZERO_SHARE, is_float_array, is_integer_array

FEW_VALUES = 8  # rows with fewer values than this are judged across the batch, never by a per-row cosine
CHANCE_LIMIT = 0.9  # a figure that a constant output reaches at this level or above cannot judge the data
POSITION_LIMIT = 65536  # per-position sums (spread per position, cosine's chance level) of at most this many positions
POSITION_SEED = 0  # which positions of a wider row are summed: the same for every batch and every run
ROW_BLOCK_VALUES = 1 << 22  # values counted at a time (float64 copies of a few blocks: tens of MB)
FLAT = 1e-12  # a reference whose variance across rows is below this share of its squared mean does not vary


@dataclass(frozen=True)
class Figure:
    """One judged output's figure under one measure. ``problem``: why the measure cannot judge this output on this
    data (it is ill-conditioned: reported, and never PASSED); ``chance``: what a constant output would score."""

    output: str
    metric: str
    value: float
    chance: float | None = None
    problem: str | None = None
    details: dict[str, Any] = field(default_factory=dict)  # what else the measure found (perplexities, ...)
    # (rows that agree, rows judged) where the figure is at most a share of rows that each agree or not (a label
    # sequence, a decoded string): such a share has an exact binomial confidence bound, which a bootstrap of rows
    # misses when every row agrees (each resample agrees too).
    agreeing: tuple[int, int] | None = None

    def describe(self) -> str:
        text = f"'{self.output}': {self.metric} {self.value:.6g}"
        if self.details:
            found = ", ".join(f"{key.replace('_', ' ')} {value:.4g}" for key, value in self.details.items())
            text += f" ({found})"
        if self.chance is not None:
            text += f" (a constant output scores {self.chance:.3g})"
        return text + (f", cannot judge: {self.problem}" if self.problem else "")

    def to_json(self) -> dict[str, object]:
        return {
            "output": self.output,
            "metric": self.metric,
            "value": self.value,
            "chance": self.chance,
            "ill_conditioned": self.problem,
            **({"details": dict(self.details)} if self.details else {}),
            **({"rows_agreeing": list(self.agreeing)} if self.agreeing else {}),
        }


@dataclass
class OutputComparison:
    """How far one output of the candidate is from the reference's, over all compared rows (``samples``)."""

    name: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0  # |c - r| / max(|r|, 1e-3 * max|r|): relative, without blowing up near zero
    mean_cosine: float = 0.0  # per row, flattened
    top1_agreement: float | None = None  # class-score outputs only
    samples: int = 0  # rows (along ``batch_axis``), not positions
    values_per_row: int = 0
    # Whether the output is class scores (top-1 agreement is counted only then).
    classifier: bool | None = field(default=None, repr=False)
    # Where given, the intersection over union of the masks reference > t and candidate > t is counted too.
    iou_threshold: float | None = field(default=None, repr=False)
    batch_axis: int = field(default=0, repr=False)  # the axis rows lie along
    # Positions that are the model's own input tokens (a language model's logits, one set per input token): judged per
    # position, since whole rows of next-token guesses almost never agree; a CTC reader's time steps are not.
    token_positions: bool = field(default=False, repr=False)
    _cosine_sum: float = field(default=0.0, repr=False)
    _scale_sum: float = field(default=0.0, repr=False)  # per row: 2s / (1 + s^2), s = shorter length / longer
    _top1_hits: int = field(default=0, repr=False)
    _top1_total: int = field(default=0, repr=False)
    _classes: np.ndarray | None = field(default=None, repr=False)  # how often the reference's top-1 is each class
    # Class scores with several positions per row ([rows, positions, classes]: a CTC reader's time steps): rows whose
    # best class at every position is unchanged, and how often the reference gives each whole sequence.
    _sequence_same: int = field(default=0, repr=False)
    _sequences: Counter | None = field(default=None, repr=False)
    # Sums over every value of every row: squared error, reference, reference squared; count, background count.
    _squared_error: float = field(default=0.0, repr=False)
    _reference_sum: float = field(default=0.0, repr=False)
    _reference_squares: float = field(default=0.0, repr=False)
    _values: int = field(default=0, repr=False)
    _background: int = field(default=0, repr=False)
    _unit_interval: bool = field(default=True, repr=False)
    _spatial: bool = field(default=True, repr=False)
    _intersection: int = field(default=0, repr=False)
    _union: int = field(default=0, repr=False)
    # Per value position (every position of rows up to POSITION_LIMIT wide, a fixed random sample of POSITION_LIMIT
    # positions of wider ones): sums of reference, its squares, squared errors, and of the reference rows scaled to
    # unit norm (cosine's chance level); the sampled positions, and the width they were drawn from.
    _positions: dict[str, np.ndarray] | None = field(default=None, repr=False)
    _picked: np.ndarray | None = field(default=None, repr=False)
    _positions_width: int = field(default=0, repr=False)
    # Integer outputs (set on the first batch), judged by agreement: equal values where the shapes match, with how
    # often each model gives each value; where they do not, items shared and items in either.
    integer: bool | None = None
    _equal: int = field(default=0, repr=False)
    _elements: int = field(default=0, repr=False)
    _reference_values: Counter | None = field(default=None, repr=False)
    _candidate_values: Counter | None = field(default=None, repr=False)
    _shared_items: int = field(default=0, repr=False)
    _all_items: int = field(default=0, repr=False)

    @property
    def spread_agreement(self) -> float:
        """1 - MSE / (2 Var(reference)): the error against how much the reference varies across rows (per value
        position: every position of rows up to :data:`POSITION_LIMIT` wide, a fixed sample of wider ones; over all
        values where rows changed width between batches). 1.0 for identical
        outputs; 0.5 for the constant output that always gives the reference's mean."""
        error, variance, _ = self._error_and_variance()
        if variance == 0.0:
            return 1.0 if error == 0.0 else 0.0
        return 1.0 - error / (2.0 * variance)

    def _error_and_variance(self) -> tuple[float, float, float]:
        """(mean squared error, the reference's variance, its mean square) on one scale: summed over value
        positions (variance across rows) where positions are kept, per value over all values otherwise."""
        if not self._values:
            return 0.0, 0.0, 0.0
        positions = self._positions
        if positions is not None and self.samples >= 2:
            mean = positions["sum"] / self.samples
            variance = np.maximum(positions["squares"] / self.samples - mean * mean, 0.0)
            squares = float(positions["squares"].sum()) / self.samples
            return float(positions["error"].sum()) / self.samples, float(variance.sum()), squares
        mean = self._reference_sum / self._values
        squares = self._reference_squares / self._values
        return self._squared_error / self._values, max(squares - mean * mean, 0.0), squares

    def _flat(self) -> bool:
        """Whether the reference hardly varies across the rows judged, so that no spread can be measured."""
        _, variance, squares = self._error_and_variance()
        return variance == 0.0 or variance <= FLAT * squares or (self._positions is not None and self.samples < 2)

    @property
    def scale_agreement(self) -> float:
        """The rows' lengths agreeing, what a per-row cosine cannot see: per row 2s / (1 + s^2) for s the shorter
        row's length over the longer's (1 for two zero rows), averaged over rows."""
        return self._scale_sum / self.samples if self.samples else 1.0

    @property
    def probability_map(self) -> bool:
        """Whether the reference looks like a detection or segmentation map: values in [0, 1] with spatial axes, at
        least :data:`NEAR_ZERO_SHARE` of them below :data:`NEAR_ZERO`."""
        return (
            self._values > 0
            and self._unit_interval
            and self._spatial
            and self._background >= NEAR_ZERO_SHARE * self._values
        )

    @property
    def background_share(self) -> float:
        return self._background / self._values if self._values else 0.0

    @property
    def mask_iou(self) -> float | None:
        """Intersection over union of the thresholded masks over all rows (1.0 when both are empty)."""
        if self.iou_threshold is None:
            return None
        return self._intersection / self._union if self._union else 1.0

    def add(self, reference: np.ndarray, candidate: np.ndarray) -> None:
        """Count one batch, its rows a block at a time (float64 copies of a language model's [batch, tokens,
        vocabulary] logits would take gigabytes at once)."""
        reference, candidate = np.asarray(reference), np.asarray(candidate)
        if self.integer is None:
            self.integer = is_integer_array(reference)
        if self.integer:
            self._add_integer(reference, candidate)
            return
        if reference.shape != candidate.shape:
            raise InputError(
                f"output '{self.name}' has shape {list(candidate.shape)} in the candidate but "
                f"{list(reference.shape)} in the reference"
            )
        self._spatial &= reference.ndim >= 3
        if reference.ndim == 0:
            reference, candidate = reference.reshape(1, 1), candidate.reshape(1, 1)
        ref_rows, cand_rows = np.moveaxis(reference, self.batch_axis, 0), np.moveaxis(candidate, self.batch_axis, 0)
        largest = float(max(ref_rows.max(initial=0), -ref_rows.min(initial=0))) if ref_rows.size else 0.0
        floor = max(largest * 1e-3, float(np.finfo(np.float32).tiny))
        width = int(np.prod(ref_rows.shape[1:], dtype=np.int64))
        block = max(1, ROW_BLOCK_VALUES // max(width, 1))
        for start in range(0, max(len(ref_rows), 1), block):
            self._add_rows(ref_rows[start : start + block], cand_rows[start : start + block], floor)
        scores = is_float_array(reference) and reference.ndim >= 2 and reference.shape[-1] >= 2
        if scores and self.classifier:  # the best class along the last axis, a block of the first axis at a time
            step = max(1, ROW_BLOCK_VALUES // max(reference[0].size, 1))
            for start in range(0, len(reference), step):
                expected = reference[start : start + step].argmax(axis=-1)
                hits = expected == candidate[start : start + step].argmax(axis=-1)
                self._top1_hits += int(hits.sum())
                self._top1_total += hits.size
                counts = np.bincount(expected.ravel(), minlength=reference.shape[-1])
                self._classes = counts if self._classes is None else self._classes + counts
            self.top1_agreement = self._top1_hits / self._top1_total
        if scores and self.classifier and not self.token_positions and ref_rows.ndim == 3 and ref_rows.shape[1] > 1:
            expected, actual = ref_rows.argmax(axis=-1), cand_rows.argmax(axis=-1)
            self._sequence_same += int(np.all(expected == actual, axis=1).sum())
            self._sequences = self._sequences if self._sequences is not None else Counter()
            self._sequences.update(map(bytes, expected.astype(np.int64)))

    def _add_integer(self, reference: np.ndarray, candidate: np.ndarray) -> None:
        """Count one batch of an integer output: equal values where the shapes match, else shared items along the
        one axis whose length differs."""
        if not is_integer_array(candidate):
            raise InputError(
                f"output '{self.name}' holds {reference.dtype.name} values in the reference but "
                f"{candidate.dtype.name} in the candidate"
            )
        if reference.ndim == 0:
            reference, candidate = reference.reshape(1), candidate.reshape(1)
        if reference.shape == candidate.shape:
            rows = np.moveaxis(reference, self.batch_axis, 0)
            self.samples += len(rows)
            self.values_per_row = int(np.prod(rows.shape[1:], dtype=np.int64))
            self._equal += int(np.count_nonzero(reference == candidate))
            self._elements += reference.size
            difference = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
            self.max_abs_error = max(self.max_abs_error, float(difference.max(initial=0.0)))
            for counts, values in (("_reference_values", reference), ("_candidate_values", candidate)):
                found, times = np.unique(values, return_counts=True)
                counter = getattr(self, counts) or Counter()
                counter.update(dict(zip(found.tolist(), times.tolist(), strict=True)))
                setattr(self, counts, counter)
            return
        differing = [axis for axis in range(reference.ndim) if reference.shape[axis] != candidate.shape[axis]]
        if reference.ndim != candidate.ndim or len(differing) != 1:
            raise InputError(
                f"output '{self.name}' has shape {list(candidate.shape)} in the candidate but "
                f"{list(reference.shape)} in the reference"
            )
        reference_items, candidate_items = (_items(values, differing[0]) for values in (reference, candidate))
        self._shared_items += sum((reference_items & candidate_items).values())
        self._all_items += sum((reference_items | candidate_items).values())

    def _add_rows(self, reference: np.ndarray, candidate: np.ndarray, floor: float) -> None:
        """Count a block of rows (the batch axis first)."""
        ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
        for which, values in (("reference", ref), ("candidate", cand)):
            if not np.isfinite(values).all():
                raise InputError(
                    f"the {which} model's output '{self.name}' contains NaN or infinite values, so no error or "
                    f"cosine means anything; check that model's weights and the input data"
                )
        diff = np.abs(cand - ref)
        self.max_abs_error = max(self.max_abs_error, float(diff.max(initial=0.0)))
        self.max_rel_error = max(self.max_rel_error, float((diff / np.maximum(np.abs(ref), floor)).max(initial=0.0)))
        rows_ref, rows_cand = ref.reshape(len(ref), -1), cand.reshape(len(cand), -1)
        lengths_ref, lengths_cand = np.linalg.norm(rows_ref, axis=1), np.linalg.norm(rows_cand, axis=1)
        norms = lengths_ref * lengths_cand
        longer = np.maximum(lengths_ref, lengths_cand)
        shorter = np.minimum(lengths_ref, lengths_cand)
        ratio = np.where(longer > 0, shorter / np.where(longer > 0, longer, 1), 1.0)
        self._scale_sum += float((2 * ratio / (1 + ratio * ratio)).sum())
        same = np.all(rows_ref == rows_cand, axis=1)
        cosine = np.where(norms > 0, (rows_ref * rows_cand).sum(axis=1) / np.where(norms > 0, norms, 1), same * 1.0)
        self._cosine_sum += float(cosine.sum())
        self.samples += len(rows_ref)
        self.values_per_row = rows_ref.shape[1]
        self.mean_cosine = self._cosine_sum / self.samples
        self._squared_error += float(np.square(diff).sum())
        self._reference_sum += float(ref.sum())
        self._reference_squares += float(np.square(ref).sum())
        self._values += ref.size
        self._background += int((ref < NEAR_ZERO).sum())
        self._unit_interval &= bool(ref.size == 0 or (ref.min() >= 0 and ref.max() <= 1))
        self._add_positions(rows_ref, rows_cand)
        if self.iou_threshold is not None:
            dense, converted = ref > self.iou_threshold, cand > self.iou_threshold
            self._intersection += int(np.logical_and(dense, converted).sum())
            self._union += int(np.logical_or(dense, converted).sum())

    def _add_positions(self, rows_ref: np.ndarray, rows_cand: np.ndarray) -> None:
        """Per-position sums while every batch has rows of one width (called after ``samples`` counts this batch: a
        later batch finding none kept leaves them off). Rows wider than :data:`POSITION_LIMIT` are summed on a fixed
        random sample of that many positions: a chance level and a spread per position need an estimate, not every
        value, and without them a constant output of wide rows that all point one way would pass by its cosine. The
        sample is random, not strided, so that a stride cannot fall on one channel of [tokens, channels] rows."""
        width = rows_ref.shape[1]
        first = self.samples == len(rows_ref)
        if (not first and self._positions is None) or (self._positions is not None and self._positions_width != width):
            self._positions = None
            return
        if width > POSITION_LIMIT:
            if self._picked is None:
                picked = np.random.default_rng(POSITION_SEED).choice(width, POSITION_LIMIT, replace=False)
                self._picked = np.sort(picked)
            rows_ref, rows_cand = rows_ref[:, self._picked], rows_cand[:, self._picked]
        self._positions_width = width
        norms = np.linalg.norm(rows_ref, axis=1, keepdims=True)
        unit = np.divide(rows_ref, norms, out=np.zeros_like(rows_ref), where=norms > 0)
        sums = {
            "sum": rows_ref.sum(axis=0),
            "squares": np.square(rows_ref).sum(axis=0),
            "error": np.square(rows_cand - rows_ref).sum(axis=0),
            "unit": unit.sum(axis=0),
        }
        if self._positions is None:
            self._positions = sums
        else:
            for key, value in sums.items():
                self._positions[key] += value

    # Figures: each measure of this output with its chance level and, where it cannot judge, the reason.

    def cosine_figure(self) -> Figure:
        chance, problem = None, None
        if self._positions is not None and self.samples:
            mean = self._positions["sum"] / self.samples
            length = float(np.linalg.norm(mean))
            chance = float(self._positions["unit"] @ mean) / (length * self.samples) if length > 0 else 0.0
        if self.values_per_row < FEW_VALUES:
            problem = (
                f"{self.values_per_row} value{'s' if self.values_per_row > 1 else ''} per row: a per-row cosine of "
                "so few values cannot see a scaled or shifted output; judge it across the batch (--metric spread, "
                "as auto does)"
            )
        elif chance is not None and chance >= CHANCE_LIMIT:
            problem = (
                f"every reference row points almost the same way (a constant output scores {chance:.3f}); judge "
                "it across the batch (--metric spread, as auto does)"
            )
        return Figure(self.name, "cosine", self.mean_cosine, chance, problem)

    def scale_figure(self) -> Figure:
        """The rows' scale agreement: judged beside the cosine (``auto``), never alone (a constant row of the
        right length agrees)."""
        return Figure(self.name, "scale", self.scale_agreement)

    def spread_figure(self) -> Figure:
        problem = None
        if self._flat():
            rows = f"{self.samples} row{'s' if self.samples != 1 else ''}"
            problem = f"the reference does not vary across the {rows} judged, so no spread can be measured; judge "
            problem += "more varied data"
        return Figure(self.name, "spread", self.spread_agreement, 0.5, problem)

    def top1_figure(self) -> Figure:
        if self.top1_agreement is None or self._classes is None:
            raise InputError(
                f"output '{self.name}' is not class scores (Softmax, or a final linear layer), so top-1 agreement "
                "means nothing there; judge it with --metric auto"
            )
        chance = float(self._classes.max() / self._classes.sum())
        problem = None
        if chance >= CHANCE_LIMIT:
            problem = (
                f"the reference gives one class to {100 * chance:.0f} % of the rows, so a constant answer agrees "
                "as often; judge more varied data"
            )
        one_per_row = self._top1_total == self.samples  # positions within a row are not independent trials
        agreeing = (self._top1_hits, self._top1_total) if one_per_row else None
        return Figure(self.name, "top1", self.top1_agreement, chance, problem, agreeing=agreeing)

    def mask_iou_figure(self) -> Figure:
        if self.mask_iou is None:
            raise InputError(f"output '{self.name}' was not compared with a mask threshold; use --metric mask-iou@T")
        problem = None
        if not self._union:
            problem = f"neither model has a value above {self.iou_threshold} in it, so no mask is compared"
        return Figure(self.name, f"mask-iou@{self.iou_threshold:g}", self.mask_iou, None, problem)

    def auto_figure(self) -> Figure:
        """The figure that fits the output: spread for probability maps (their per-row cosine measures background
        noise) and for rows of few values or rows that all point one way; otherwise the per-row cosine, or the
        rows' scale agreement where that is lower."""
        if self.integer:
            return self.agreement_figure()
        if self.probability_map or self.values_per_row < FEW_VALUES:
            return self.spread_figure()
        cosine = self.cosine_figure()
        figure = self.spread_figure() if cosine.problem else cosine
        if not cosine.problem:
            scale = self.scale_figure()
            figure = scale if scale.value < figure.value else figure
        if self._sequences:  # a sequence of class scores: what is read is the row's labels, which cosine hides
            sequence = self.sequence_figure()
            if sequence.problem or sequence.value < figure.value:
                return sequence
            return replace(figure, agreeing=sequence.agreeing)  # judged by the lower of the two, bounded by both
        return figure

    def sequence_figure(self) -> Figure:
        """Rows whose best class at every position is unchanged, with the chance level of a constant answer."""
        rows = sum(self._sequences.values()) if self._sequences else 0
        chance = self._sequences.most_common(1)[0][1] / rows if rows else 1.0
        problem = None
        if chance >= CHANCE_LIMIT:
            problem = (
                f"the reference gives one label sequence to {100 * chance:.0f} % of the rows, so a constant answer "
                "agrees as often; judge more varied data"
            )
        value = self._sequence_same / rows if rows else 0.0
        return Figure(self.name, "sequence", value, chance, problem, agreeing=(self._sequence_same, rows))

    def as_dict(self) -> dict[str, float | int | str | None]:
        hidden = ("classifier", "iou_threshold", "batch_axis")
        fields = {key: value for key, value in vars(self).items() if not key.startswith("_") and key not in hidden}
        if self.integer:  # distances between labels mean nothing: their agreement does
            fields = {key: fields[key] for key in ("name", "samples", "values_per_row", "integer")}
            return fields | {"agreement": self.agreement_figure().value}
        return fields | {"spread_agreement": self.spread_agreement, "scale_agreement": self.scale_agreement}

    def agreement_figure(self) -> Figure:
        """An integer output's agreement: equal values corrected for chance, (p - e) / (1 - e), e the share two
        independent draws from each model's value frequencies agree on (a constant answer scores 0; the plain share
        where the reference gives one value); where item counts differed, the lower of that and the items shared
        over the items in either."""
        if not self.integer:
            raise InputError(f"output '{self.name}' is not an integer output; agreement judges labels and indices")
        figures, details, chance = [], {}, None
        if self._elements:
            observed = self._equal / self._elements
            reference, candidate = self._reference_values or Counter(), self._candidate_values or Counter()
            expected = sum(count * candidate[value] for value, count in reference.items()) / self._elements**2
            details |= {"equal_share": observed, "chance_agreement": expected}
            if len(reference) == 1:  # nothing varies to agree by chance on: every value must stay
                figures.append(observed)
            else:
                figures.append((observed - expected) / (1 - expected))
                chance = 0.0
        if self._all_items:
            overlap = self._shared_items / self._all_items
            details["item_overlap"] = overlap
            figures.append(overlap)
        value = min(figures) if figures else 1.0  # no items in either model: nothing differs
        return Figure(self.name, "agreement", float(value), chance, None, details)


def _items(values: np.ndarray, axis: int) -> Counter:
    """The items of ``values`` along ``axis`` (each the slice at one index), as a multiset of their bytes."""
    rows = np.ascontiguousarray(np.moveaxis(values, axis, 0).astype(np.int64)).reshape(values.shape[axis], -1)
    return Counter(row.tobytes() for row in rows)
