"""The one registry style of every pluggable family (fitting methods, activation-range methods, runtime backends,
training methods, fidelity metrics): a member registers itself with a decorator that names it, says in one line
what it does and declares its options, ``@FAMILY.register(name, help=..., **options)``. Help text and validation
are read from the registry, never from a copied list of names.

A registry is a read-only mapping, name -> member (a class, a function, or one instance of a class for families
that keep one), in registration order; :meth:`Registry.entry` gives the name, help and options the member was
registered with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nmdeploy.errors import InputError

Member = TypeVar("Member")


@dataclass(frozen=True)
class Entry(Generic[Member]):
    """One registered member: its name, its one-line help, the options it declared and the member itself."""

    name: str
    help: str
    member: Member
    options: Mapping[str, Any] = field(default_factory=dict)


class Registry(Mapping[str, Member]):
    """Name -> member of one family (``family`` names it in errors: "unknown range method 'x'; choose one of ...").

    ``instances``: the family keeps one instance of each registered class (backends), not the class. A registered
    class gets ``name`` and ``help`` as class attributes, so its own code can say what it is."""

    def __init__(self, family: str, *, instances: bool = False) -> None:
        self.family = family
        self.instances = instances
        self._entries: dict[str, Entry[Any]] = {}

    def register(self, name: str, *, help: str, **options: Any) -> Callable[[Any], Any]:
        """The decorator that adds a member under ``name``; a name registered already is an error (a bug)."""

        def add(target: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"a {self.family} named {name!r} is registered already")
            if isinstance(target, type):
                target.name, target.help = name, help
            member = target() if self.instances else target
            self._entries[name] = Entry(name, help, member, dict(options))
            return target

        return add

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a toy member take it out again)."""
        del self._entries[name]

    def entry(self, name: str) -> Entry[Member]:
        """The entry of ``name``; an unknown name is an InputError listing the known ones."""
        if name not in self._entries:
            raise InputError(f"unknown {self.family} {name!r}; choose one of {', '.join(self._entries)}")
        return self._entries[name]

    def lookup(self, name: str) -> Member:
        """The member ``name``, checked as :meth:`entry` checks it."""
        return self.entry(name).member

    def entries(self) -> list[Entry[Member]]:
        return list(self._entries.values())

    def help_text(self, default: str | None = None) -> str:
        """Every member with its help, the ``default`` marked: the help of the flag that chooses one."""
        return "; ".join(
            f"{name} ({entry.help}{', default' if name == default else ''})" for name, entry in self._entries.items()
        )

    def __getitem__(self, name: str) -> Member:
        return self._entries[name].member

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
