"""N:M patterns: keep N elements out of every group of M consecutive ones."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nmdeploy.errors import PatternError

_PATTERN_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class Pattern:
    """N kept out of every M (2:4 keeps two of every four)."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or isinstance(self.m, bool):
            raise PatternError(f"pattern values must be integers, got {self.n!r}:{self.m!r}")
        if not isinstance(self.n, int) or not isinstance(self.m, int):
            raise PatternError(f"pattern values must be integers, got {self.n!r}:{self.m!r}")
        if self.m < 2:
            raise PatternError(f"pattern {self.n}:{self.m}: M must be at least 2")
        if self.n < 1:
            raise PatternError(f"pattern {self.n}:{self.m}: N must be at least 1")
        if self.n >= self.m:  # N = M keeps every element: a pattern every dense weight follows, so no check
            raise PatternError(
                f"pattern {self.n}:{self.m}: N must be below M (N:M keeps N of every M elements); use one such as 2:4"
            )

    @classmethod
    def parse(cls, text: str | Pattern) -> Pattern:
        """Parse ``"N:M"`` (for example ``"2:4"``); a Pattern passes through unchanged."""
        if isinstance(text, Pattern):
            return text
        if not isinstance(text, str):
            raise PatternError(f"expected a pattern string such as '2:4', got {text!r}")
        match = _PATTERN_RE.match(text)
        if match is None:
            raise PatternError(f"invalid pattern {text!r}: expected 'N:M' with integers, such as '2:4'")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def density(self) -> float:
        """Fraction of elements kept."""
        return self.n / self.m

    @property
    def sparsity(self) -> float:
        """Fraction of elements pruned."""
        return 1.0 - self.density

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


PatternLike = Pattern | str
