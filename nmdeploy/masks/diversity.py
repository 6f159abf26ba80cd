"""Mask diversity: how many distinct masks a sparsity constraint allows (Hubara et al. 2021).

Hubara et al. use the number of masks that satisfy a constraint as a proxy for how much accuracy the constraint
can keep, so nmdeploy counts them exactly for a tensor of T elements:

* unstructured at density d, k = round(d*T) kept: ``C(T, k)``;
* 1-D N:M: ``C(M, N) ** (T / M)``;
* transposable N:M on M x M tiles: ``R(M, N) ** (T / M**2)``, where R(M, N) is the number of M x M 0/1 matrices whose
  rows and columns all sum to N (R(4, 2) = 90, R(8, 4) = 116,963,796,250; OEIS A008300 / A058527).

The product formula printed in the paper, ``M!(M-1)!...(M-N+1)!``, is not a count (it gives 144 for 2:4 where the
truth is 90), so R(M, N) is counted by :func:`count_binary_matrices`.

Two rules keep this cheap:

* **Materialising the count.** ``MaskDiversity.count`` is an exact ``int`` when ``numel <= EXACT_NUMEL_LIMIT``;
  above that the integer would have up to hundreds of thousands of digits, so ``count`` is ``None`` and ``log10`` is
  computed from logarithms (``math.lgamma`` for the binomial) without building it.
* **Intractable R(M, N).** The exact count's cost grows like the number of partitions in an M x N box: R(16, 8) for
  8:16 takes about 1-3 s, R(20, 10) about 90 s, and R(32, 16) for 16:32 would need about 2e10 dynamic-programming
  states. Beyond ``EXACT_WORK_LIMIT`` :func:`count_binary_matrices` raises :class:`IntractableCountError`, and
  :func:`mask_diversity` returns the Canfield-McKay estimate marked ``exact=False`` (or raises, if
  ``allow_estimate=False``). The estimate's ratio to the truth is 0.88 at R(4, 2), 0.94 at R(8, 4), 0.97 at
  R(16, 8) and 0.985 at R(32, 4): it tends to 1 like 1 - 0.5/M, so its log10 for 16:32 should be within about
  0.007 per tile (checked at M = 32 only for N <= 4, which is all that can be counted there).
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

from nmdeploy.errors import InputError, IntractableCountError, PatternError, ShapeError
from nmdeploy.masks.pattern import Pattern, PatternLike

__all__ = [
    "EXACT_NUMEL_LIMIT",
    "EXACT_WORK_LIMIT",
    "MASK_KINDS",
    "IntractableCountError",
    "MaskDiversity",
    "count_binary_matrices",
    "estimate_log10_binary_matrices",
    "mask_diversity",
]

_log = logging.getLogger(__name__)

MASK_KINDS: tuple[str, ...] = ("unstructured", "nm", "transposable")
"""The mask types :func:`mask_diversity` counts."""

EXACT_NUMEL_LIMIT = 100_000
"""Largest tensor size for which :attr:`MaskDiversity.count` holds the exact integer (above it: ``None``)."""

EXACT_WORK_LIMIT = 650_000
"""Work budget for an exact R(M, N), in the units of the cost model: a few seconds at most (R(16, 8) is 595k)."""


@dataclass(frozen=True)
class MaskDiversity:
    """The number of masks a constraint allows, with its log10 for comparisons.

    ``count`` is the exact integer, or ``None`` when it was not materialised (see :data:`EXACT_NUMEL_LIMIT`) or is
    not known exactly. ``exact`` is False only when ``log10`` comes from an asymptotic estimate rather than an exact
    count.
    """

    count: int | None
    log10: float
    exact: bool = True


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{what} must be an integer, got {value!r}")
    return value


def _box_partition_counts(m: int, n: int) -> list[int]:
    """Coefficients of the Gaussian binomial [m+n choose n]_q: entry t counts the DP states of residual total t.

    A DP state is a multiset of m column residuals in 0..n, i.e. a partition of t in an m x n box.
    """
    # prod_{i=1..n} (1 - q^(m+i)) / (1 - q^i), as power series truncated at degree m*n (the product is a polynomial).
    degree = m * n
    coeffs = [0] * (degree + 1)
    coeffs[0] = 1
    for i in range(1, n + 1):
        shift = m + i
        for t in range(degree, shift - 1, -1):
            coeffs[t] -= coeffs[t - shift]
        for t in range(i, degree + 1):
            coeffs[t] += coeffs[t - i]
    return coeffs


@cache
def _exact_work(m: int, n: int) -> int:
    """Cost model for R(m, n), 2 <= n <= m/2: m times the number of DP states on the rows computed.

    The DP touches partial-row states of roughly that number; measured cost is about 3-11 microseconds per unit
    (R(16, 8): 595k units, about 2 s). Only used to refuse hopeless counts up front.
    """
    rows = m - m // 2
    if n * n * m > 2_000_000:
        # Expanding the polynomial would itself be slow; the count is far out of reach anyway, and the average
        # coefficient gives its order of magnitude.
        return math.comb(m + n, n) // (m * n + 1) * m * rows
    coeffs = _box_partition_counts(m, n)
    return m * sum(coeffs[n * (m - r)] for r in range(rows))


def _row_layers(m: int, n: int, rows: int) -> list[dict[int, int]]:
    """Forward DP over rows: layer r maps a multiset of column residuals to the number of r x m prefixes reaching it.

    A state is the vector (c_0, ..., c_n), c_k = number of columns that still need k ones, packed as base-(m+1)
    digits into one int. A row puts its n ones into n distinct columns; instead of enumerating all compositions
    (j_1, ..., j_n) of n at once (weight prod_k C(c_k, j_k)), the row is applied class by class, k = 1..n, so partial
    rows that reach the same intermediate state are merged before the next class is processed.
    """
    base = m + 1
    powers = [base**k for k in range(n + 1)]
    binomials = [[math.comb(c, j) for j in range(c + 1)] for c in range(m + 1)]
    layer: dict[int, int] = {m * powers[n]: 1}
    layers = [layer]
    for _ in range(rows):
        finished: dict[int, int] = {}
        # Partial key: (state, ones left in this row, columns in classes >= k). Classes >= k are untouched so far,
        # so the third entry is a function of the state and merging stays correct.
        partial: dict[tuple[int, int, int], int] = {(state, n, m): ways for state, ways in layer.items()}
        for k in range(1, n + 1):
            following: dict[tuple[int, int, int], int] = {}
            power, move = powers[k], powers[k] - powers[k - 1]
            for (state, left, untouched), ways in partial.items():
                in_class = (state // power) % base
                above = untouched - in_class
                low = max(left - above, 0)  # the classes above must be able to take the rest of the row
                high = min(in_class, left)
                row_binomials = binomials[in_class]
                for j in range(low, high + 1):
                    # j columns of class k get a one and move to class k - 1.
                    target = state - j * move
                    weight = ways * row_binomials[j]
                    if j == left:
                        finished[target] = finished.get(target, 0) + weight
                    else:
                        key = (target, left - j, above)
                        following[key] = following.get(key, 0) + weight
            partial = following
        layer = finished
        layers.append(layer)
    return layers


@cache
def _exact_count(m: int, n: int) -> int:
    """R(m, n) for 2 <= n <= m/2 by meeting in the middle of the row DP."""
    top = m - m // 2
    bottom = m // 2
    layers = _row_layers(m, n, top)
    base = m + 1
    factorial_m = math.factorial(m)
    total = 0
    for state, top_ways in layers[top].items():
        digits = [(state // base**k) % base for k in range(n + 1)]
        # The bottom rows must supply exactly what the top rows left: residual k there is n - k here. Bottom
        # prefixes of `bottom` rows with column sums v are prefixes whose residual is n - v, so reversing the digits
        # looks them up in the same forward DP.
        mirrored = sum(c * base ** (n - k) for k, c in enumerate(digits))
        bottom_ways = layers[bottom].get(mirrored, 0)
        if not bottom_ways:
            continue
        # Both counts are summed over the labelled column vectors with this multiset; per vector they are equal.
        labelled = factorial_m
        for c in digits:
            labelled //= math.factorial(c)
        total += (top_ways // labelled) * (bottom_ways // labelled) * labelled
    return total


def count_binary_matrices(m: int, n: int, *, max_work: int | None = EXACT_WORK_LIMIT) -> int:
    """Exact number R(m, n) of m x m 0/1 matrices with every row and column sum n: the transposable tile count.

    Uses R(m, n) = R(m, m - n) (complement every entry) and a row DP over multisets of column residuals, met in the
    middle. Results are memoised. Raises :class:`IntractableCountError` when the predicted work exceeds
    ``max_work`` (``None``: no limit), rather than running for hours.
    """
    m = _check_int(m, "matrix size m")
    n = _check_int(n, "row and column sum n")
    if m < 0 or not 0 <= n <= m:
        raise PatternError(f"R({m}, {n}): need 0 <= n <= m")
    n = min(n, m - n)
    if n == 0:
        return 1
    if n == 1:
        return math.factorial(m)  # permutation matrices (or their complements)
    if max_work is not None:
        work = _exact_work(m, n)
        if work > max_work:
            raise IntractableCountError(
                f"exact R({m}, {n}) needs about {work:.2g} units of dynamic-programming work (limit {max_work:,}, "
                f"about 2 s per 600k); use estimate_log10_binary_matrices({m}, {n}) or pass max_work=None and wait"
            )
    return _exact_count(m, n)


def _log10_binomial(total: int, chosen: int) -> float:
    """log10 C(total, chosen) from lgamma, without building the integer."""
    lg = math.lgamma
    return (lg(total + 1) - lg(chosen + 1) - lg(total - chosen + 1)) / math.log(10)


def estimate_log10_binary_matrices(m: int, n: int) -> float:
    """Canfield-McKay estimate of log10 R(m, n), for tiles too large to count exactly.

    R(m, n) ~ exp(-1/2) C(m, n)^(2m) / C(m^2, m n) (Canfield and McKay 2005, dense 0/1 matrices with equal row and
    column sums); it underestimates by a factor that tends to 1 like 1 - 0.5/m (0.97 at m = 16).
    """
    m = _check_int(m, "matrix size m")
    n = _check_int(n, "row and column sum n")
    if m < 1 or not 0 <= n <= m:
        raise PatternError(f"R({m}, {n}): need 0 <= n <= m and m >= 1")
    if n in (0, m):
        return 0.0
    return 2 * m * _log10_binomial(m, n) - _log10_binomial(m * m, m * n) - 0.5 / math.log(10)


def _check_density(density: object) -> Fraction:
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise InputError(f"density must be a number in [0, 1], got {density!r}")
    value = float(density)
    if not math.isfinite(value) or not 0 <= value <= 1:
        raise InputError(f"density must be within [0, 1], got {density!r}")
    return Fraction(value)


def _diversity(base: int, repeats: int, numel: int) -> MaskDiversity:
    """``base ** repeats``, materialised only for small tensors."""
    if numel <= EXACT_NUMEL_LIMIT:
        count = base**repeats
        return MaskDiversity(count, math.log10(count))
    return MaskDiversity(None, repeats * math.log10(base))


def mask_diversity(
    numel: int,
    kind: str,
    pattern: PatternLike | None = None,
    density: float | None = None,
    *,
    allow_estimate: bool = True,
) -> MaskDiversity:
    """Number of distinct masks of type ``kind`` for a tensor of ``numel`` elements (Hubara et al.'s mask diversity).

    ``kind`` is ``"unstructured"`` (``round(density * numel)`` kept, ties to even; density defaults to N/M of
    ``pattern``), ``"nm"`` (1-D N:M groups of M) or ``"transposable"`` (N per row and column of M x M tiles); the
    last two need ``pattern`` and a ``numel`` that M (resp. M**2) divides. A ``density`` given with a pattern must
    equal N/M. When R(M, N) is out of exact reach the result is the Canfield-McKay estimate with ``exact=False``,
    or an :class:`IntractableCountError` if ``allow_estimate`` is False.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ShapeError(f"numel must be a non-negative integer, got {numel!r}")
    if kind not in MASK_KINDS:
        raise InputError(f"unknown mask kind {kind!r}; choose one of {', '.join(MASK_KINDS)}")
    parsed = None if pattern is None else Pattern.parse(pattern)
    wanted = None if density is None else _check_density(density)
    if parsed is not None and wanted is not None and wanted != Fraction(parsed.n, parsed.m):
        raise InputError(f"density {density!r} contradicts pattern {parsed} (density {parsed.n}/{parsed.m})")

    if kind == "unstructured":
        if wanted is None:
            if parsed is None:
                raise InputError("kind 'unstructured' needs a density or a pattern to take N/M from")
            wanted = Fraction(parsed.n, parsed.m)
        kept = round(wanted * numel)
        if numel <= EXACT_NUMEL_LIMIT:
            count = math.comb(numel, kept)
            return MaskDiversity(count, math.log10(count))
        return MaskDiversity(None, _log10_binomial(numel, kept))

    if parsed is None:
        raise InputError(f"kind {kind!r} needs a pattern such as '2:4'")
    if kind == "nm":
        if numel % parsed.m:
            raise ShapeError(f"1-D pattern {parsed} needs numel to be a multiple of {parsed.m}, got {numel}")
        return _diversity(math.comb(parsed.m, parsed.n), numel // parsed.m, numel)

    tile = parsed.m * parsed.m
    if numel % tile:
        raise ShapeError(
            f"transposable pattern {parsed} needs numel to be a multiple of {parsed.m}x{parsed.m} = {tile}, got {numel}"
        )
    try:
        per_tile = count_binary_matrices(parsed.m, parsed.n)
    except IntractableCountError as exc:
        if not allow_estimate:
            raise IntractableCountError(
                f"transposable {parsed}: no exact mask diversity (allow_estimate=True gives the Canfield-McKay "
                f"estimate, marked exact=False): {exc}"
            ) from exc
        _log.debug("transposable %s: using the Canfield-McKay estimate (%s)", parsed, exc)
        return MaskDiversity(None, numel // tile * estimate_log10_binary_matrices(parsed.m, parsed.n), exact=False)
    return _diversity(per_tile, numel // tile, numel)
