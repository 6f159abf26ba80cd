"""The exception hierarchy: every error a user can cause derives from :class:`Error`.

The CLI turns an :class:`Error` into one line and a non-zero exit; anything else keeps its traceback,
because it is a bug in nmdeploy rather than in the input.
"""

from __future__ import annotations


class Error(Exception):
    """Root of every nmdeploy error caused by input, configuration or environment."""


class PatternError(Error, ValueError):
    """An N:M pattern string or value that nmdeploy cannot use."""


class ShapeError(Error, ValueError):
    """A tensor whose shape or axis does not fit the requested operation."""


class InputError(Error, ValueError):
    """Input data that cannot be used as given (NaN scores, unreadable files, ...)."""


class MissingDependencyError(Error, ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


class IntractableCountError(Error, ValueError):
    """An exact count that would take far too long to compute; the message says why and what to use instead."""


class ComplianceError(Error):
    """A model that should follow an N:M pattern does not (raised by verification)."""


def first_line(error: BaseException, limit: int | None = None) -> str:
    """The first line of an error's message (at most ``limit`` characters), or its type's name when it has none:
    what a one-line report of someone else's failure (a library's, a user's function's) can quote."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
