"""The regression report as a table ending in a greppable PASSED or FAILED line."""

from __future__ import annotations

from nmdeploy.evaluation.regress.judging import RegressionReport
from nmdeploy.tables import render_table

COLUMNS = ("model", "check", "baseline", "tol", "measured", "spread (runs)", "better", "status")


def format_report(report: RegressionReport) -> str:
    """A table of every check, regressions marked, and a greppable last line."""
    rows = [
        (
            check.model,
            f"{check.key[0]} {check.label}",
            f"{check.baseline:.4g}",
            f"{check.tolerance:.3g}",
            None if check.measured is None else f"{check.measured:.4g}",
            f"{max(check.runs) - min(check.runs):.3g} ({len(check.runs)})" if check.runs else None,
            "higher" if check.higher_is_better else "lower",
            check.status.upper() if check.status == "regressed" else check.status,
        )
        for check in report.checks
    ]
    lines = [render_table(COLUMNS, rows, right=("baseline", "tol", "measured", "better"))]
    regressed = report.regressed
    if report.created:
        lines.append(f"CREATED | {report.path}: {len(report.checks)} baselines from the measured values")
    elif report.updated:
        lines.append(f"UPDATED | {report.path}: {len(report.checks)} baselines rewritten with the measured values")
    elif regressed:
        lines.append(f"FAILED | {len(regressed)} of {len(report.checks)} checks regressed: {report.failure_summary}")
    else:
        improved = sum(c.status == "improved" for c in report.checks)
        hint = f" ({improved} improved beyond tolerance: consider --update)" if improved else ""
        lines.append(f"PASSED | {len(report.checks)} checks within tolerance{hint}")
    return "\n".join(lines)
