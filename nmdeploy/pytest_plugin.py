"""pytest plugin: nmdeploy's regression checks inside a user's own test suite.

Two ways in (the plugin is registered through the ``pytest11`` entry point, or ``-p nmdeploy.pytest_plugin``):

- ``pytest --nm-baselines models/mlp/baselines.toml`` adds one test per baselines file, failing with each regressed
  figure against its bound on the first line (what ``-ra`` shows) and the table of every check below;
- the ``nm_regress`` fixture runs a baselines file from a test: ``nm_regress("models/mlp/baselines.toml")``.

``--nm-update-baselines`` rewrites the baseline numbers instead of judging them, as ``nmdeploy regress --update``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from nmdeploy.errors import Error
from nmdeploy.evaluation.regress import RegressionReport, format_report, run_regression


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nmdeploy", "N:M sparsity regression checks")
    group.addoption(
        "--nm-baselines",
        action="append",
        default=[],
        metavar="FILE",
        help="run the accuracy/latency checks of this baselines TOML file as a test (repeatable)",
    )
    group.addoption(
        "--nm-update-baselines",
        action="store_true",
        help="rewrite the baseline numbers with the measured ones instead of judging them",
    )


def check_baselines(path: str | Path, update: bool = False) -> RegressionReport:
    """Run one baselines file; fail the current test with the table when something regressed or the file is bad."""
    try:
        report = run_regression(path, update=update)
    except Error as error:
        # Most errors already name the file; say it once.
        pytest.fail(str(error) if str(path) in str(error) else f"{path}: {error}", pytrace=False)
    if report.regressed:
        # pytest's short summary shows the message's first line: the regressed figures, not the table's border.
        pytest.fail(f"{report.failure_summary}\n{format_report(report)}", pytrace=False)
    return report


@pytest.fixture
def nm_regress(request: pytest.FixtureRequest) -> Callable[..., RegressionReport]:
    """``nm_regress(path)`` checks a baselines file and returns the report; regressions fail the test."""
    update = bool(request.config.getoption("nm_update_baselines"))

    def run(path: str | Path, *, update: bool = update) -> RegressionReport:
        return check_baselines(path, update=update)

    return run


class BaselinesItem(pytest.Item):
    """One baselines file given with --nm-baselines, run as a test."""

    def __init__(self, *, baselines: Path, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.baselines = baselines

    def runtest(self) -> None:
        report = check_baselines(self.baselines, update=bool(self.config.getoption("nm_update_baselines")))
        self.add_report_section("call", "nmdeploy regress", format_report(report))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.baselines, None, f"nmdeploy regress {self.baselines}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for file in config.getoption("nm_baselines"):
        path = Path(file).resolve()
        items.append(BaselinesItem.from_parent(session, name=f"nm-baselines[{file}]", baselines=path))
