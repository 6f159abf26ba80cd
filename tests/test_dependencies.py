"""The dependency audit, in two parts.

1. The test environment holds exactly the distributions that nmdeploy's declared requirements reach (the test extra,
   and any other extra installed whole, such as tensorrt on a GPU machine), at versions they accept: a distribution
   nothing declared (a leftover of an older install, something installed by hand) fails, by name.
2. What the test extra reaches is, name for name, what the reviewed lock (requirements/test.txt) pins: a dependency
   that starts requiring a new distribution, or a pyproject.toml changed without refreshing the lock, fails the day
   it appears in an environment, until the lock is refreshed (``bash .ci/lock``) and its diff reviewed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dependency_tree import INSTALLER, PROJECT, PYPROJECT, declared, extras_of, installed, walk
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def audited_extras(available) -> list[str]:
    """The test extra, and each other extra whose own requirements are all installed."""
    runtime = {str(requirement) for requirement in declared()}
    whole = [
        extra
        for extra in extras_of()
        if extra != "test"
        and all(
            canonicalize_name(requirement.name) in available or requirement.name == PROJECT
            for requirement in declared([extra])
            if str(requirement) not in runtime and (requirement.marker is None or requirement.marker.evaluate())
        )
    ]
    return ["test", *whole]


def undeclared(available) -> tuple[list[str], object]:
    tree = walk(declared(audited_extras(available)), available)
    allowed = set(tree.reached) | INSTALLER | {PROJECT}
    extra = sorted(f"{available[name].metadata['Name']} {available[name].version}" for name in set(available) - allowed)
    return extra, tree


def test_installed_distributions_are_exactly_the_declared_trees():
    available = installed()
    if PROJECT not in available:
        pytest.skip("nmdeploy is not installed in this environment (a checkout on PYTHONPATH): nothing to audit")
    extra, tree = undeclared(available)
    assert not tree.missing, f"declared but not installed: {tree.missing}"
    assert not tree.mismatched, f"installed at a version a requirement excludes: {tree.mismatched}"
    assert not extra, (
        f"installed but reached by no declared requirement of nmdeploy[{','.join(audited_extras(available))}]: "
        f"{extra}; declare what nmdeploy uses, remove the rest (see README, 'Extras')"
    )


LOCK = PYPROJECT.parent / "requirements" / "test.txt"


def locked_names(lock: Path = LOCK) -> set[str]:
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", lock.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {canonicalize_name(name) for name in pins}


def test_the_test_extra_reaches_exactly_what_the_reviewed_lock_pins():
    available = installed()
    if PROJECT not in available:
        pytest.skip("nmdeploy is not installed in this environment (a checkout on PYTHONPATH): nothing to audit")
    reached = set(walk(declared(["test"]), available).reached)
    locked = locked_names()
    assert not reached - locked, (
        f"reached from nmdeploy[test] but not in the reviewed lock: {sorted(reached - locked)}; vet it, then "
        "refresh the lock (bash .ci/lock)"
    )
    assert not locked - reached, f"pinned by the lock but reached by nothing declared: {sorted(locked - reached)}"


def write_distribution(site: Path, name: str, version: str, requires: list[str] = ()) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {requirement}" for requirement in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")


def test_the_walk_follows_extras_and_markers_and_finds_what_nothing_declared(tmp_path):
    site = tmp_path / "site"
    write_distribution(site, "alpha", "1.0", ["beta>=2", 'gamma[fast]; extra == "speed"', 'old; python_version < "3"'])
    write_distribution(site, "beta", "2.5", ["Delta_Lib"])
    write_distribution(site, "delta-lib", "0.1")
    write_distribution(site, "gamma", "3.0", ['epsilon; extra == "fast"', 'zeta; extra == "slow"'])
    write_distribution(site, "epsilon", "1.0")
    write_distribution(site, "zeta", "1.0")
    write_distribution(site, "stray", "9.9", ["beta"])
    available = installed([str(site)])

    plain = walk([Requirement("alpha")], available)
    assert set(plain.reached) == {"alpha", "beta", "delta-lib"}  # delta-lib: names compared canonically
    assert not plain.missing and not plain.mismatched

    fast = walk([Requirement("alpha[speed]")], available)
    assert set(fast.reached) == {"alpha", "beta", "delta-lib", "gamma", "epsilon"}  # not zeta: extra "slow"
    assert set(available) - set(fast.reached) == {"zeta", "stray"}

    strict = walk([Requirement("alpha>=2"), Requirement("omega")], available)
    assert strict.missing == ["omega"]
    assert strict.mismatched == ["alpha 1.0 (asked: alpha>=2)"]
