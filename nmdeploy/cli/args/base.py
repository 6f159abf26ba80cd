"""The shape every argument group has: it declares one flag family and reads it back, once for every verb."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

Parser = argparse.ArgumentParser | argparse._ArgumentGroup


class ArgGroup:
    """One flag family (Polygraphy's argument groups): :meth:`add_to` declares its flags with their help, and
    :meth:`parse` turns them into what the library takes, checked, so a flag means the same in every verb that takes
    it. ``title``, where set, heads the family's section of ``--help``."""

    title: str | None = None

    def add_to(self, parser: Parser) -> None:
        """Declare the family's flags on ``parser`` (in its own ``--help`` section where the group has a title)."""
        self.add_flags(parser.add_argument_group(self.title) if self.title else parser)

    def add_flags(self, parser: Parser) -> None:
        raise NotImplementedError

    def parse(self, args: argparse.Namespace) -> Any:
        """The family's settings, read from parsed ``args``; bad values are one-line :class:`nmdeploy.Error` s."""
        raise NotImplementedError


class LazyText:
    """Text made only when shown: a flag's help read from a registry whose module ``--help`` alone should not
    import. Set it as an attribute of the flag's action and name it in the help (``%(methods)s``)."""

    def __init__(self, make: Callable[[], str]) -> None:
        self.make = make

    def __str__(self) -> str:
        return self.make()


def add_groups(parser: Parser, *groups: ArgGroup) -> None:
    """Declare every group's flags on ``parser``, in order."""
    for group in groups:
        group.add_to(parser)


def comma_list(text: str) -> list[str]:
    """``A,B`` -> ``["A", "B"]`` (blanks dropped), for flags that take names separated by commas."""
    return [part.strip() for part in text.split(",") if part.strip()]
