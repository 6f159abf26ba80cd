"""Typed report rows: what a pass or a step reports about each weight, node or stage it handled.

Each producer defines its own dataclass rows; readers use their attributes, and ``--json`` prints ``to_json()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def optional(default: Any = None) -> Any:
    """A report field left out of the JSON while it is None (a skipped weight has no 'retained', for example)."""
    return field(default=default, metadata={"optional": True})


@dataclass
class ReportRow:
    """One row of a pass's report: a weight, node or step it looked at. Each pass defines its own row types;
    ``to_json`` gives the form ``--json`` prints: the fields in order, optional ones only when set."""

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None and item.metadata.get("optional"):
                continue
            document[item.name] = value
        return document
