"""The pass interface: a small class with one ``call(model) -> PassResult``, run in order by :class:`Sequential`.

A pass says honestly whether it changed the model, because managers and reports rely on it, and may check what
it needs (``requires``) and what it promises (``ensures``); ``__call__`` runs those checks around ``call``. A pass
is a function of its inputs: what it is given when made, and the model; ``call`` keeps nothing on the pass object,
so one pass object serves any number of models. The errors are named as onnx-ir's pass infrastructure names them:
a model the pass cannot take is a :class:`PreconditionError`, a result that breaks the pass's promise a
:class:`PostconditionError` (a bug in the pass, never a bare AssertionError).
"""

from __future__ import annotations

import abc
import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nmdeploy.errors import Error
from nmdeploy.graph.model import OnnxModel
from nmdeploy.rows import ReportRow, optional

__all__ = [
    "Pass",
    "PassResult",
    "PassRow",
    "PostconditionError",
    "PreconditionError",
    "ReportRow",
    "Sequential",
    "optional",
]

log = logging.getLogger(__name__)


class PreconditionError(Error):
    """The model cannot go through the pass as it stands (``requires`` says why)."""


class PostconditionError(RuntimeError):
    """A pass broke its own promise (``ensures`` says which): a bug in the pass, never the user's input, so not an
    :class:`nmdeploy.Error`: the command line shows its traceback and exits with the internal-error code, never the
    one of a bad input (2) or of a regression (1)."""


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
    """A graph transformation or check. Configuration is keyword-only and validated in ``__init__``; no I/O there.

    ``in_place``: ``call`` changes the model it is given and returns that same object (True), or returns a new model
    and leaves its input as it was (False); ``__call__`` holds the pass to it. ``requires`` and ``ensures`` inspect
    the model they are given (``ensures`` the result's model and rows), never state kept on the pass, so one pass
    object can run on several models.
    """

    name: ClassVar[str]
    in_place: ClassVar[bool] = True

    def __call__(self, model: OnnxModel) -> PassResult:
        self.requires(model)
        result = self.call(model)
        if self.in_place and result.model is not model:
            raise PostconditionError(f"{self.name} works in place but returned another model")
        if not self.in_place and result.model is model and result.modified:
            raise PostconditionError(f"{self.name} does not work in place but changed the model it was given")
        try:
            self.ensures(result)
        except (PostconditionError, AssertionError) as error:  # an AssertionError: a pass written outside nmdeploy
            raise PostconditionError(f"{self.name} did not ensure what it promises: {error}") from error
        log.info("%s: %s", self.name, "modified the model" if result.modified else "no change")
        return result

    @abc.abstractmethod
    def call(self, model: OnnxModel) -> PassResult:
        """Do the work; return whether the model changed."""

    def requires(self, model: OnnxModel) -> None:  # noqa: B027 - optional hook
        """Raise a :class:`PreconditionError` (or another nmdeploy.Error naming the input) if the model cannot go
        through this pass."""

    def ensures(self, result: PassResult) -> None:  # noqa: B027 - optional hook
        """Raise :class:`PostconditionError` if ``result.model`` does not hold what the pass promises (a bug, not a
        user error)."""


class Sequential(Pass):
    """Passes in order; itself a pass, so pipelines nest. It works in place when every step does; otherwise it
    returns a new model and leaves the one it was given as it was, whatever the order of its steps. A failure names
    the pass that failed and the one before it ("quantize failed after prune: ..."), in the same exception, so a
    user error stays one line."""

    name = "sequential"

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)

    @property
    def in_place(self) -> bool:  # type: ignore[override]
        return all(step.in_place for step in self.passes)

    def call(self, model: OnnxModel) -> PassResult:
        modified = False
        report: list[ReportRow] = []
        previous: Pass | None = None
        # Not in place as a whole (a step returns a copy): the caller's model stays as it was, so an in-place step
        # that would run on it runs on a copy instead (none is made where a copying step has made one already).
        owned = self.in_place
        for step in self.passes:
            if step.in_place and not owned:
                model, owned = copy.deepcopy(model), True
            try:
                result = step(model)
            except Exception as error:
                _name_the_failure(error, step, previous)
                raise
            owned = owned or result.model is not model
            model, modified = result.model, modified or result.modified
            report.extend(PassRow(step.name, row) for row in result.report)
            previous = step
        return PassResult(model, modified, report)


def _name_the_failure(error: Exception, step: Pass, previous: Pass | None) -> None:
    """Prefix the message of ``error`` (an nmdeploy error or a broken promise, whose message is the whole report)
    with the pass that failed and the one before it; any other exception (a bug) gets it as a note beside its
    traceback. The innermost Sequential names it; the ones around it leave it as it is."""
    if getattr(error, "_nmdeploy_failed_pass", None):
        return
    where = f"{step.name} failed " + (f"after {previous.name}" if previous else "as the first pass")
    error._nmdeploy_failed_pass = step.name  # type: ignore[attr-defined]
    if isinstance(error, (Error, AssertionError)) and error.args and isinstance(error.args[0], str):
        error.args = (f"{where}: {error.args[0]}", *error.args[1:])
    else:
        error.add_note(where)
