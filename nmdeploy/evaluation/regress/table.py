"""The regression report as a fixed-width table ending in a greppable PASSED or FAILED line."""

from __future__ import annotations

from nmdeploy.evaluation.regress.judging import RegressionReport


def format_report(report: RegressionReport) -> str:
    """A fixed-width table of every check, regressions marked, and a greppable last line."""
    rows = [(c.model, f"{c.key[0]} {c.label}", c) for c in report.checks]
    model_width = max([5, *(len(r[0]) for r in rows)]) + 2
    check_width = max([5, *(len(r[1]) for r in rows)]) + 2
    lines = [
        f"{'model':<{model_width}}{'check':<{check_width}}{'baseline':>10} {'tol':>8} {'measured':>10} "
        f"{'better':>7}  status"
    ]
    for model, label, check in rows:
        measured = "-" if check.measured is None else f"{check.measured:.4g}"
        status = check.status.upper() if check.status == "regressed" else check.status
        lines.append(
            f"{model:<{model_width}}{label:<{check_width}}{check.baseline:>10.4g} {check.tolerance:>8.3g} "
            f"{measured:>10} {'higher' if check.higher_is_better else 'lower':>7}  {status}"
        )
    regressed = report.regressed
    if report.updated:
        lines.append(f"UPDATED | {report.path}: {len(report.checks)} baselines rewritten with the measured values")
    elif regressed:
        names = ", ".join(f"{c.model} {c.key[0]} {c.label}" for c in regressed)
        lines.append(f"FAILED | {len(regressed)} of {len(report.checks)} checks regressed: {names}")
    else:
        improved = sum(c.status == "improved" for c in report.checks)
        hint = f" ({improved} improved beyond tolerance: consider --update)" if improved else ""
        lines.append(f"PASSED | {len(report.checks)} checks within tolerance{hint}")
    return "\n".join(lines)
