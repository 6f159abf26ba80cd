"""Backends that run a model: each is a Runner (context manager with ``inputs`` and ``infer(feeds) -> dict``).

Backends import their engine lazily, so a missing optional one never breaks the rest of nmdeploy.
"""

from nmdeploy.runtimes.base import InputSpec, Runner

__all__ = ["InputSpec", "Runner"]
