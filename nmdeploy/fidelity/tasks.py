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
            vocabulary = np.shape(reference[name])[-1]
            stats = self.stats.setdefault(
                name,
                {
                    "reference": 0.0,
                    "candidate": 0.0,
                    "kl": 0.0,
                    "hits": 0,
                    "count": 0,
                    "classes": Counter(),  # the reference's best next tokens
                    "targets": Counter(),  # the next tokens fed
                    "entropy": 0.0,  # sum of the reference distributions' entropies
                    "mean": np.zeros(vocabulary),  # sum of the reference distributions
                },
            )
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
        probabilities = np.exp(expected)
        stats["kl"] += float((probabilities * (expected - actual)).sum())
        stats["entropy"] -= float((probabilities * expected).sum())
        stats["mean"] += probabilities.sum(axis=0)
        best = expected.argmax(axis=-1)
        stats["hits"] += int((best == actual.argmax(axis=-1)).sum())
        stats["classes"].update(best.tolist())
        stats["targets"].update(np.asarray(targets).tolist())
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

    def perplexity_figure(self, name: str, stats: dict[str, Any]) -> Figure:
        """The smaller of the two perplexities over the larger: a candidate far less perplexed than its reference
        (one that reads the token it is asked to predict) is not faithful to it either. The best constant
        prediction, the fed next tokens' own frequencies, and every flatter one give a perplexity at or above
        that one's: a reference no better than it (random token ids) is matched by some constant output, so
        the figure cannot judge the data."""
        details = self.perplexities(stats)
        reference, candidate = details["reference_perplexity"], details["candidate_perplexity"]
        counts = np.fromiter(stats["targets"].values(), dtype=np.float64)
        shares = counts / counts.sum()
        constant = float(np.exp(-(shares * np.log(shares)).sum()))
        problem = None
        if reference >= CHANCE_LIMIT * constant:
            problem = (
                f"the reference's perplexity on these tokens ({reference:.4g}) is no better than a constant "
                f"prediction's ({constant:.4g}): they are not text it predicts (random token ids?); judge real text "
                "(nmdeploy data text) or use --metric kl"
            )
        value = min(reference / candidate, candidate / reference)
        chance = min(reference / constant, 1.0)  # constants (at any temperature) reach every perplexity above it
        return Figure(name, "perplexity", value, chance, problem, details)

    def divergence_figure(self, name: str, stats: dict[str, Any]) -> Figure:
        """exp(-KL(reference || candidate)) averaged over positions; a constant prediction's best, the reference's
        mean distribution, scores exp(-(H(mean) - mean H)): near 1 where the reference predicts alike everywhere."""
        count = stats["count"]
        divergence = max(stats["kl"] / count, 0.0)
        mean = stats["mean"] / count
        spread = float(-(mean[mean > 0] * np.log(mean[mean > 0])).sum()) - stats["entropy"] / count
        chance = float(np.exp(-max(spread, 0.0)))
        problem = None
        if chance >= CHANCE_LIMIT:
            problem = (
                f"the reference predicts nearly the same next-token distribution at every position (a constant "
                f"output scores {chance:.3f}); judge more varied text"
            )
        details = {"kl": divergence, **self.perplexities(stats)}
        return Figure(name, "kl", float(np.exp(-divergence)), chance, problem, details)


@metric(
    "perplexity",
    help="next-token perplexity of the logits on the input_ids fed: the smaller of the reference's and the "
    "candidate's perplexity over the larger (1.0 the same, 0.5 twice or half as perplexed)",
)
class Perplexity(_NextToken):
    label = "perplexity"

    def figure(self, name, stats):
        return self.perplexity_figure(name, stats)


class LanguageModelAuto(_NextToken):
    """``auto`` on a causal language model's logits: next-token perplexity where the tokens fed are text the
    reference predicts, else (random token ids) the next-token KL, which needs no such text."""

    label = "perplexity"

    def figure(self, name, stats):
        perplexity = self.perplexity_figure(name, stats)
        if not perplexity.problem:
            return perplexity
        divergence = self.divergence_figure(name, stats)
        return perplexity if divergence.problem else divergence


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
        return self.divergence_figure(name, stats)
