"""What a conversion reports: one row per weight (converted with its measured errors, or skipped with the reason),
the summary of its cost and the approximations its memory budget forced, and reading the rows back (which weights
changed, which were left dense and why)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from nmdeploy.errors import InputError
from nmdeploy.passes.base import ReportRow, optional

BLOCK_COST = (
    "cross-block input correlations are dropped; measured on MiniLM's FFN projections (K = 1536): output error "
    "+37-40 % with blocks of K/2, +75-80 % with K/4 (block_diagonal_cost in nmdeploy.masks.blockwise)"
)


@dataclass
class ConvertedWeight(ReportRow):
    """One weight: skipped (and why), or its mask's method, the saliency it kept, the zeros it kept of those it had,
    and, when fitted on calibration data, the output error of the plain mask and of the fitted weight."""

    step: str = field(default="convert", init=False)
    weight: str
    node: str | None = optional()  # the consumer node's name (PrunableWeight.node_label), as tables show it
    skipped: str | None = optional()
    shape: list[int] | None = optional()
    axis: int | None = optional()
    method: str | None = optional()
    retained_saliency: float | None = optional()
    zeros_before: int | None = optional()
    zeros_kept: int | None = optional()
    error_masked: float | None = optional()
    error_converted: float | None = optional()
    samples: int | None = optional()
    # "full" or "block-diagonal, blocks of B of K columns" (errors are then on those blocks), the float32
    # statistics' size, and the fit's precision (float64 for small layers and where float32 failed)
    statistics: str | None = optional()
    statistics_mb: float | None = optional()
    precision: str | None = optional()


@dataclass
class ConversionSummary(ReportRow):
    """The conversion's cost; the calibration fields are set when a fit read calibration data."""

    step: str = field(default="summary", init=False)
    seconds: float
    converted: int
    peak_rss_mb: float
    calibration_seconds: float | None = optional()
    calibration_batches: int | None = optional()
    calibration_samples: int | None = optional()
    segments: int | None = optional()
    cached_peak_mb: float | None = optional()
    spilled: bool | None = optional()
    spilled_mb: float | None = optional()
    max_memory_mb: float | None = optional()  # the memory budget the statistics were planned in
    approximations: list[str] | None = optional()  # every approximation the budget forced, with its measured cost
    row_by_row: bool | None = optional()  # the model runs only at batch 1: calibrated one row per run
    fit_target: str | None = optional()  # what the sequential fit matched (passes.fit_target.FIT_TARGETS)
    damping: float | None = optional()  # the fit's damping, relative to mean diag(X^T X) (passes.fit_target)
    # --reconstruct: regions found, regions whose trained weights were kept (their error fell), the mean relative
    # output error of the regions on the calibration batches before and after, and the seconds spent training
    reconstruction_regions: int | None = optional()
    reconstructed_regions: int | None = optional()
    reconstruction_error_before: float | None = optional()
    reconstruction_error_after: float | None = optional()
    reconstruction_seconds: float | None = optional()


def conversion_summary(
    start: float,
    statistics_run,
    rows: list[ReportRow],
    converted_count: int,
    max_memory: int | None,
    row_by_row: bool,
) -> ConversionSummary:
    """The conversion's cost: wall time, calibration data used, peak memory, whether cached values spilled, the
    memory budget (None: no statistics were planned) and the approximations it forced. ``statistics_run``: the
    statistics engine's summary of its run (None: the method read no statistics)."""
    row = ConversionSummary(time.perf_counter() - start, converted_count, peak_rss_mb())
    row.row_by_row = row_by_row or None
    if max_memory is not None:
        row.max_memory_mb = max_memory / 2**20
        converted = [r for r in rows if isinstance(r, ConvertedWeight)]
        blocked = [r for r in converted if r.statistics and r.statistics.startswith("block")]
        skipped = [r for r in converted if r.skipped and "--max-memory" in r.skipped]
        notes = []
        if blocked:
            notes.append(f"block-diagonal statistics for {len(blocked)} layer(s) beyond the budget: {BLOCK_COST}")
        if skipped:
            notes.append(f"{len(skipped)} layer(s) left dense: their statistics do not fit even in blocks")
        row.approximations = notes or None
    if statistics_run is not None:
        row.calibration_seconds = statistics_run.seconds
        row.calibration_batches = statistics_run.batches
        row.calibration_samples = statistics_run.samples
        row.segments = statistics_run.segments
        row.cached_peak_mb = statistics_run.cached_peak_bytes / 2**20
        row.spilled = statistics_run.spilled
        row.spilled_mb = statistics_run.spilled_bytes / 2**20
        regions = statistics_run.regions
        if regions is not None:  # reconstruction was asked for
            row.reconstruction_regions = len(regions)
            row.reconstructed_regions = sum(region.kept for region in regions)
            if regions:
                row.reconstruction_error_before = sum(r.error_before for r in regions) / len(regions)
                row.reconstruction_error_after = sum(r.error_after for r in regions) / len(regions)
                row.reconstruction_seconds = sum(r.seconds for r in regions)
    return row


def conversion_outcome(
    rows: Iterable[ReportRow], budgeted: bool = False
) -> tuple[list[ConvertedWeight], dict[str, str]]:
    """(the weights a conversion changed, weight -> why it was left dense); an InputError with the reasons where a
    conversion without a budget changed none (statistics out of reach everywhere: nothing was done)."""
    weights = [row for row in rows if isinstance(row, ConvertedWeight)]
    skipped = {row.weight: row.skipped for row in weights if row.skipped}
    if not budgeted and len(skipped) == len(weights):
        raise InputError(f"nothing to convert: every selected weight was left dense ({_reasons(skipped)})")
    return [row for row in weights if not row.skipped], skipped


def _reasons(skipped: dict[str, str], shown: int = 6) -> str:
    """Why weights were left dense, most frequent first, each reason whole with its count: a reason cut mid-sentence
    can say the opposite of what it meant."""
    counts = Counter(skipped.values()).most_common()
    text = "; ".join(f"{count} weight{'s' * (count > 1)}: {reason}" for reason, count in counts[:shown])
    more = len(counts) - shown
    return text + (f"; and {more} other reason{'s' * (more > 1)}" if more > 0 else "")


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB.

    Linux's VmHWM belongs to the running program alone; getrusage's ru_maxrss also keeps the peak of the process
    that forked it (it survives exec), so a conversion started from a large Python process would report that.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not on Windows
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
