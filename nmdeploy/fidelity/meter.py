"""Measuring a metric over (reference outputs, candidate outputs, feeds) batches: every judged output's comparison,
the measure's figure per output, and one figure for the model (the lowest, so that every judged output must keep
the bar), refused where a figure cannot judge the data."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.fidelity.comparison import Figure, OutputComparison
from nmdeploy.fidelity.registry import FidelityMetric, TaskMetric, metric_value, parse_spec
from nmdeploy.fidelity.selection import OutputSelection, feed_rows, follows_tokens, rows_axis, select_outputs
from nmdeploy.fidelity.tasks import LanguageModelAuto, next_token_outputs

Batch = tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray], Mapping[str, np.ndarray]]


class IllConditionedError(InputError):
    """A figure that the data at hand cannot move (a per-row cosine of one value, a reference that never varies):
    reported, never PASSED."""

    def __init__(self, message: str, figures: Sequence[Figure]) -> None:
        super().__init__(message)
        self.figures = list(figures)


def model_figure(figures: Sequence[Figure], metric: str = "") -> float:
    """One figure for a model: the lowest judged output's. A figure that cannot judge is an
    :class:`IllConditionedError` naming the output and why."""
    if not figures:
        raise InputError("no output was judged, so there is no fidelity figure; name the outputs with --outputs")
    unjudged = [figure for figure in figures if figure.problem]
    if unjudged:
        first = unjudged[0]
        raise IllConditionedError(
            f"--metric {metric or first.metric} cannot judge output '{first.output}' on this data: {first.problem}",
            figures,
        )
    return min(figure.value for figure in figures)


def output_figure(output: OutputComparison, metric: str = "auto") -> Figure:
    """One output's figure under a built-in output measure (``auto``, ``cosine``, ``spread``, ``top1``,
    ``mask-iou@T``)."""
    parsed = parse_spec(metric)
    if parsed is None or parsed[0].task:
        raise InputError(f"--metric {metric}: not a measure of one output")
    entry, option = parsed
    if output.integer:  # labels and indices: agreement, whatever measure judges the float outputs
        return output.agreement_figure()
    return entry.judge(output, option)


def model_fidelity(outputs: Sequence[OutputComparison], metric: str = "auto") -> float:
    """One figure over the judged outputs' comparisons under an output measure: the lowest output's (for ``top1``
    the class-score outputs' top-1 agreement and every other output's ``auto`` figure)."""
    if metric == "top1":
        return model_figure(top1_figures(outputs), metric)
    return model_figure([output_figure(output, metric) for output in outputs], metric)


def top1_figures(outputs: Sequence[OutputComparison]) -> list[Figure]:
    """``top1``: the class-score outputs' top-1 agreement, every other judged output's ``auto`` figure."""
    if not any(output.top1_agreement is not None for output in outputs):
        raise InputError("--metric top1 needs a class-score output (Softmax, or a final linear layer); use auto")
    return [output.auto_figure() if output.top1_agreement is None else output.top1_figure() for output in outputs]


class Meter:
    """A metric accumulated batch by batch: the judged outputs (``outputs``, or by default those
    :func:`select_outputs` picks on the first batch), each one's :class:`OutputComparison` (top-1 counted on the
    ``classifiers``, rows along ``batch_axes`` or else the axis whose length is the batch's), the built-in
    measure's figures, or a user metric's mean over batches."""

    def __init__(
        self,
        metric: FidelityMetric = "auto",
        outputs: Sequence[str] | None = None,
        classifiers: Collection[str] | None = None,
        batch_axes: Mapping[str, int] | None = None,
    ) -> None:
        self.metric = metric
        self.requested = outputs
        self.classifiers = frozenset(classifiers or ())
        self.batch_axes = dict(batch_axes or {})
        self.parsed = None if callable(metric) else parse_spec(metric)
        if not callable(metric) and self.parsed is None:
            raise InputError(f"--metric {metric!r}: not a built-in measure nor a 'package.module:function'")
        self.selection: OutputSelection | None = None
        self.comparisons: dict[str, OutputComparison] = {}
        self.axes: dict[str, int] = {}
        self.task: TaskMetric | None = None
        self.user_values: list[float] = []
        self.batches = 0

    @property
    def user(self) -> bool:
        return callable(self.metric)

    def add(self, expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray], feeds) -> None:
        if self.selection is None:
            self._start(expected, actual, feeds)
        for name, comparison in self.comparisons.items():
            comparison.add(expected[name], actual[name])
        if self.task is not None:
            self.task.add(expected, actual, feeds, self.axes)
        if self.user:
            self.user_values.append(metric_value(self.metric, expected, actual, feeds))
        self.batches += 1

    def _start(self, expected, actual, feeds) -> None:
        self.selection = select_outputs(expected, feeds, self.requested, required=not self.user)
        missing = [name for name in self.selection.judged if name not in actual]
        if missing:
            raise InputError(f"the candidate has no output named '{missing[0]}'")
        rows = feed_rows(feeds)
        threshold = None
        if self.parsed is not None and self.parsed[0].name == "mask-iou":
            threshold = self.parsed[1]
        for name in self.selection.judged:
            axis, shape = self.batch_axes.get(name), np.shape(expected[name])
            self.axes[name] = rows_axis(shape, rows) if axis is None or axis >= len(shape) else axis
            self.comparisons[name] = OutputComparison(
                name,
                classifier=name in self.classifiers,
                iou_threshold=threshold,
                batch_axis=self.axes[name],
                token_positions=follows_tokens(np.shape(expected[name]), self.axes[name], feeds),
            )
        if self.parsed is not None and self.parsed[0].task:
            entry, option = self.parsed
            self.task = entry.judge(self.selection.judged, option)
        elif self.parsed is not None and self.parsed[0].name == "auto":
            # A language model's logits are judged by what it is deployed for, its next tokens: cosine of logits
            # stays near 0.9 while perplexity grows fivefold (a one-shot 2:4 SmolLM2-135M: 0.92 against 14.7 -> 69.9).
            judged = {name: expected[name] for name in self.selection.judged}
            language = next_token_outputs(judged, feeds, self.axes)
            if language:
                self.task = LanguageModelAuto(language, None)

    def figures(self) -> list[Figure]:
        """Each judged output's figure under the measure (none for a user metric): the measure's where it applies
        (a task measure's outputs, top-1's class scores), ``auto``'s on every other judged output, so that no
        judged output goes unseen (a key/value cache beside the logits --metric perplexity judges)."""
        if self.parsed is None:
            return []
        entry, option = self.parsed
        outputs = list(self.comparisons.values())
        if self.task is not None:
            by_task = {figure.output: figure for figure in self.task.figures()}
            if entry.task:
                return [by_task.get(output.name) or output.auto_figure() for output in outputs]
            # auto: a language model's logits by their next tokens, unless their values (cosine, scale) are lower or
            # the tokens cannot judge: the position after the last token fed has no next token to score, and damage
            # there shows only in the values.
            figures = []
            for output in outputs:
                own, task = output.auto_figure(), by_task.get(output.name)
                lower = not own.problem and (task is None or task.problem or own.value < task.value)
                figures.append(own if lower else task)
            return figures
        if entry.task:
            return []
        if entry.name == "top1":
            return top1_figures(outputs)
        return [output_figure(output, str(self.metric)) for output in outputs]

    def value(self) -> float:
        """The model's figure: the user metric's mean over batches, or the lowest judged output's figure."""
        if not self.batches:
            raise InputError("no batches to measure fidelity on")
        if self.user:
            return float(np.mean(self.user_values))
        return model_figure(self.figures(), str(self.metric))


def measure(
    batches: Iterable[Batch],
    metric: FidelityMetric = "auto",
    outputs: Sequence[str] | None = None,
    classifiers: Collection[str] | None = None,
    batch_axes: Mapping[str, int] | None = None,
) -> Meter:
    """A :class:`Meter` fed every batch."""
    meter = Meter(metric, outputs, classifiers, batch_axes)
    for expected, actual, feeds in batches:
        meter.add(expected, actual, feeds)
    return meter


def fidelity(
    batches: Iterable[Batch],
    metric: FidelityMetric = "auto",
    outputs: Sequence[str] | None = None,
    classifiers: Collection[str] | None = None,
    batch_axes: Mapping[str, int] | None = None,
) -> float:
    """One figure for (reference outputs, candidate outputs, feeds) batches: 1.0 means the candidate is the
    reference (see :class:`Meter`)."""
    return measure(batches, metric, outputs, classifiers, batch_axes).value()


def metric_label(
    metric: FidelityMetric, selection: OutputSelection | None = None, figures: Sequence[Figure] = ()
) -> str:
    """The measure's name for reports: what the figures were judged by (``auto`` is named by the measures it
    chose: "cosine", "spread", "cosine/spread"), a user metric "custom"."""
    if not isinstance(metric, str):
        return "custom"
    used = list(dict.fromkeys(figure.metric for figure in figures))
    if metric != "auto":  # the measure first, then what auto judged the outputs it does not apply to by
        measure = metric.partition("@")[0]
        return "/".join([metric] + [name for name in used if name.partition("@")[0] != measure])
    if used:
        return "/".join(used)
    if selection is not None and selection.maps and set(selection.maps) == set(selection.judged):
        return "spread"
    return "auto"
