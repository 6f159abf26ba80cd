"""Task measures on whole outputs: CTC greedy decodes, label sequences, and a language model's next-token
predictions (perplexity, top-1, KL), the last reading the token ids fed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.fidelity.comparison import CHANCE_LIMIT, ROW_BLOCK_VALUES, Figure
from nmdeploy.fidelity.registry import TaskMetric, metric
from nmdeploy.fidelity.selection import is_float_array


def _index(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else -1
    if value < 0:
        raise ValueError("the blank index after '@' must be a class index (0 or more), e.g. ctc@0")
    return value


class _RowAgreement(TaskMetric):
    """Share of rows whose answer (a tuple per row) is the same in both models, with the chance level of a
    constant answer (the reference's most frequent one)."""

    label = ""

    def __init__(self, outputs, option) -> None:
        super().__init__(outputs, option)
        self.same = dict.fromkeys(self.outputs, 0)
        self.answers: dict[str, Counter] = {name: Counter() for name in self.outputs}

    def answers_of(self, name: str, values: np.ndarray, axis: int) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def add(self, reference, candidate, feeds, axes) -> None:
        for name in self.outputs:
            expected = self.answers_of(name, np.asarray(reference[name]), axes.get(name, 0))
            actual = self.answers_of(name, np.asarray(candidate[name]), axes.get(name, 0))
            self.same[name] += sum(a == b for a, b in zip(expected, actual, strict=True))
            self.answers[name].update(expected)

    def figures(self) -> list[Figure]:
        figures = []
        for name in self.outputs:
            rows = sum(self.answers[name].values())
            chance = self.answers[name].most_common(1)[0][1] / rows if rows else 1.0
            problem = None
            if chance >= CHANCE_LIMIT:
                problem = (
                    f"the reference gives one answer to {100 * chance:.0f} % of the {rows} rows, so a constant answer "
                    "agrees as often; judge more varied data"
                )
            value = self.same[name] / rows if rows else 0.0
            figures.append(Figure(name, self.label, value, chance, problem, agreeing=(self.same[name], rows)))
        return figures


def _labels(name: str, values: np.ndarray, axis: int, what: str) -> np.ndarray:
    """[rows, positions] of best classes (the last axis) of a float output with the batch on ``axis``."""
    if values.ndim != 3 or axis not in (0, 1):
        raise InputError(
            f"--metric {what} judges outputs shaped [batch, time, classes] or [time, batch, classes]; output "
            f"'{name}' has shape {list(values.shape)}: name the outputs to judge with --outputs"
        )
    return np.moveaxis(values, axis, 0).argmax(axis=-1)


@metric(
    "ctc",
    help="share of rows whose greedy CTC decode (best class per step, repeats merged, blanks dropped) is the same; "
    "BLANK: the blank class (default 0, or the model's)",
    option="BLANK",
    default=None,
    parse=_index,
)
class CtcAgreement(_RowAgreement):
    label = "ctc"

    def answers_of(self, name, values, axis):
        labels = _labels(name, values, axis, "ctc")
        blank = self.option or 0
        if blank >= values.shape[-1]:
            raise InputError(f"--metric ctc@{blank}: output '{name}' has only {values.shape[-1]} classes")
        previous = np.concatenate([np.full((len(labels), 1), -1), labels[:, :-1]], axis=1)
        kept = (labels != blank) & (labels != previous)
        return [tuple(row[keep].tolist()) for row, keep in zip(labels, kept, strict=True)]


@metric(
    "sequence",
    help="share of rows whose whole label sequence is the same: the best class at each position of float "
    "[batch, positions, classes] outputs, the values of integer outputs",
)
class SequenceAgreement(_RowAgreement):
    label = "sequence"

    def answers_of(self, name, values, axis):
        if is_float_array(values):
            labels = _labels(name, values, axis, "sequence")
        else:
            labels = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1) if values.ndim else values[None]
        return [tuple(row.ravel().tolist()) for row in labels]


def token_ids(feeds: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
    """The token ids a language model was fed ([batch, tokens]: ``input_ids``, or the one 2-D integer input) and
    its ``attention_mask`` where fed."""
    ids = feeds.get("input_ids")
    if ids is None:
        integer = [v for v in feeds.values() if np.ndim(v) == 2 and np.issubdtype(np.asarray(v).dtype, np.integer)]
        ids = integer[0] if len(integer) == 1 else None
    if ids is None:
        raise InputError(
            "the language-model measures read the token ids fed: the model needs an input named input_ids (or "
            "exactly one 2-D integer input)"
        )
    mask = feeds.get("attention_mask")
    return np.asarray(ids), None if mask is None or np.shape(mask) != np.shape(ids) else np.asarray(mask)


ECHO_LIMIT = 0.5  # a reference whose best token is the fed token itself this often is a masked LM, not a causal one


def next_token_outputs(
    reference: Mapping[str, np.ndarray], feeds: Mapping[str, np.ndarray], axes: Mapping[str, int]
) -> tuple[str, ...]:
    """The outputs of ``reference`` (one batch) that are a causal language model's next-token logits: float
    [batch, tokens, vocabulary] along the token ids fed, with a vocabulary that holds every fed id, whose best token
    is mostly not the fed token itself (a masked LM's is: it predicts each position, not the one after). A token
    classifier's few labels cannot hold the fed ids. Empty where no token ids were fed."""
    try:
        ids, _ = token_ids(feeds)
    except InputError:
        return ()
    if ids.ndim != 2 or ids.shape[1] < 2 or ids.size == 0 or ids.min() < 0:
        return ()
    found = []
    for name, values in reference.items():
        values = np.asarray(values)
        if axes.get(name, 0) != 0 or values.ndim != 3 or values.shape[:2] != ids.shape or not is_float_array(values):
            continue
        if ids.max() >= values.shape[-1]:
            continue
        if float((values.argmax(axis=-1) == ids).mean()) > ECHO_LIMIT:
            continue
        found.append(name)
    return tuple(found)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class _NextToken(TaskMetric):
    """Next-token statistics of logits [batch, tokens, vocabulary] against the token ids fed: each position's
    prediction of the token after it (positions the attention mask hides, and the last, are not counted)."""

    label = ""

    def __init__(self, outputs, option) -> None:
        super().__init__(outputs, option)
        self.stats: dict[str, dict[str, Any]] = {}

    def add(self, reference, candidate, feeds, axes) -> None:
        ids, mask = token_ids(feeds)
        logits = [name for name in self.outputs if np.shape(reference[name])[:2] == ids.shape]
        logits = [name for name in logits if np.ndim(reference[name]) == 3]
        if not logits:
            shapes = ", ".join(f"'{n}' {list(np.shape(reference[n]))}" for n in self.outputs)
            raise InputError(
                f"--metric {self.label}: no judged output is logits [batch, tokens, vocabulary] for the fed "
                f"input_ids {list(ids.shape)} ({shapes}); name the logits with --outputs"
            )
        for name in logits:
            stats = self.stats.setdefault(
                name, {"reference": 0.0, "candidate": 0.0, "kl": 0.0, "hits": 0, "count": 0, "classes": Counter()}
            )
            vocabulary = np.shape(reference[name])[-1]
            if ids.size and (ids.min() < 0 or ids.max() >= vocabulary):
                raise InputError(f"input_ids hold token ids outside output '{name}''s {vocabulary} vocabulary entries")
            step = max(1, ROW_BLOCK_VALUES // vocabulary)  # positions at a time: float64 copies stay tens of MB
            for row in range(ids.shape[0]):
                keep = np.ones(ids.shape[1] - 1, dtype=bool)
                if mask is not None:
                    keep = (mask[row, 1:] != 0) & (mask[row, :-1] != 0)
                positions = np.flatnonzero(keep)
                for start in range(0, len(positions), step):
                    chosen = positions[start : start + step]
                    self._count(stats, reference[name][row, chosen], candidate[name][row, chosen], ids[row, chosen + 1])

    @staticmethod
    def _count(stats: dict[str, Any], reference: np.ndarray, candidate: np.ndarray, targets: np.ndarray) -> None:
        """Count positions whose logits are ``reference`` / ``candidate`` [positions, vocabulary], next tokens
        ``targets``."""
        expected = _log_softmax(np.asarray(reference, dtype=np.float64))
        actual = _log_softmax(np.asarray(candidate, dtype=np.float64))
        positions = np.arange(len(targets))
        stats["reference"] -= float(expected[positions, targets].sum())
        stats["candidate"] -= float(actual[positions, targets].sum())
        stats["kl"] += float((np.exp(expected) * (expected - actual)).sum())
        best = expected.argmax(axis=-1)
        stats["hits"] += int((best == actual.argmax(axis=-1)).sum())
        stats["classes"].update(best.tolist())
        stats["count"] += len(targets)

    def figures(self) -> list[Figure]:
        if not any(stats["count"] for stats in self.stats.values()):
            raise InputError(f"--metric {self.label}: no token position to judge (every row is one token or masked)")
        return [self.figure(name, stats) for name, stats in self.stats.items() if stats["count"]]

    def figure(self, name: str, stats: dict[str, Any]) -> Figure:
        raise NotImplementedError

    @staticmethod
    def perplexities(stats: dict[str, Any]) -> dict[str, float]:
        count = stats["count"]
        return {
            "reference_perplexity": float(np.exp(stats["reference"] / count)),
            "candidate_perplexity": float(np.exp(stats["candidate"] / count)),
            "positions": count,
        }


@metric(
    "perplexity",
    help="next-token perplexity of the logits on the input_ids fed: reference / candidate perplexity (1.0 the "
    "same, 0.5 twice as perplexed)",
)
class Perplexity(_NextToken):
    label = "perplexity"

    def figure(self, name, stats):
        details = self.perplexities(stats)
        value = details["reference_perplexity"] / details["candidate_perplexity"]
        return Figure(name, self.label, value, details=details)


@metric("next-token", help="share of token positions whose most likely next token is the same (language models)")
class NextTokenAgreement(_NextToken):
    label = "next-token"

    def figure(self, name, stats):
        chance = stats["classes"].most_common(1)[0][1] / stats["count"]
        problem = None
        if chance >= CHANCE_LIMIT:
            problem = f"the reference predicts one token at {100 * chance:.0f} % of the positions; judge other text"
        return Figure(name, self.label, stats["hits"] / stats["count"], chance, problem, self.perplexities(stats))


@metric("kl", help="exp(-KL(reference || candidate)) of the next-token distributions, averaged over positions")
class NextTokenDivergence(_NextToken):
    label = "kl"

    def figure(self, name, stats):
        divergence = max(stats["kl"] / stats["count"], 0.0)
        details = {"kl": divergence, **self.perplexities(stats)}
        return Figure(name, self.label, float(np.exp(-divergence)), details=details)
