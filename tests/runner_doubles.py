"""A test double for graph runners: the runner a backend opened, wrapped so that a test sees every run it makes."""

from __future__ import annotations

from nmdeploy.errors import InputError


class RecordingRunner:
    """Runs ``inner`` and appends ``label`` to ``runs`` each time; while ``refusing`` holds anything, refuses instead
    (the InputError a backend gives for a graph it cannot run)."""

    def __init__(self, inner, label, runs: list, refusing: list | None = None):
        self.inner, self.label, self.runs, self.refusing = inner, label, runs, refusing

    def to_device(self, values):
        return self.inner.to_device(values)

    def run(self, feeds):
        self.runs.append(self.label)
        if self.refusing:
            raise InputError(f"the recording backend refused {self.label}")
        return self.inner.run(feeds)
