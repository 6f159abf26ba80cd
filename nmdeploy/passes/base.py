"""The pass interface: a small class with one ``call(model) -> PassResult``, run in order by :class:`Sequential`.

A pass says honestly whether it changed the model, because managers and reports rely on it, and may check what
it needs (``requires``) and what it promises (``ensures``); ``__call__`` runs those checks around ``call``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nmdeploy.graph.model import OnnxModel
from nmdeploy.rows import ReportRow, optional

__all__ = ["Pass", "PassResult", "PassRow", "ReportRow", "Sequential", "optional"]

log = logging.getLogger(__name__)


@dataclass
class PassRow(ReportRow):
    """A row of one pass inside a :class:`Sequential` (a recipe), labelled with the pass's name."""

    pass_name: str
    row: ReportRow

    def to_json(self) -> dict[str, Any]:
        return {"pass": self.pass_name, **self.row.to_json()}


@dataclass
class PassResult:
    model: OnnxModel
    modified: bool
    report: list[ReportRow] = field(default_factory=list)  # one row per weight (or item) the pass looked at

    def report_json(self) -> list[dict[str, Any]]:
        return [row.to_json() for row in self.report]


class Pass(abc.ABC):
    """A graph transformation or check. Configuration is keyword-only and validated in ``__init__``; no I/O there."""

    name: ClassVar[str]

    def __call__(self, model: OnnxModel) -> PassResult:
        self.requires(model)
        result = self.call(model)
        self.ensures(result)
        log.info("%s: %s", self.name, "modified the model" if result.modified else "no change")
        return result

    @abc.abstractmethod
    def call(self, model: OnnxModel) -> PassResult:
        """Do the work; return whether the model changed."""

    def requires(self, model: OnnxModel) -> None:  # noqa: B027 - optional hook
        """Raise an nmdeploy.Error if the model cannot go through this pass."""

    def ensures(self, result: PassResult) -> None:  # noqa: B027 - optional hook
        """Raise if the pass did not establish what it promises (a bug, not a user error)."""


class Sequential(Pass):
    """Passes in order; itself a pass, so pipelines nest."""

    name = "sequential"

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)

    def call(self, model: OnnxModel) -> PassResult:
        modified = False
        report: list[ReportRow] = []
        for step in self.passes:
            result = step(model)
            model, modified = result.model, modified or result.modified
            report.extend(PassRow(step.name, row) for row in result.report)
        return PassResult(model, modified, report)
