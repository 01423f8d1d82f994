"""Skips under CI, and the one line that sums up a local run's skips.

A test that cannot run here (no root, no podman, no ssh client, a Python package missing) skips, and says why.
On a developer's machine that is right: the rest of the suite still runs. Under CI (the ``CI`` environment
variable set, as every CI service does) a skip would turn a green run into a lie (the multi-host tests did not
run, yet the run passed), so there a skip is a failure that names what is missing. Only tests marked ``gpu``
(hardware a CI machine of this project cannot have) may skip under CI.

Locally the run ends with one line: the suites that skipped, how many tests each, and why.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

ALLOWED_MARKER = "gpu"  # the only tests that may skip under CI


def under_ci() -> bool:
    """True when the ``CI`` variable says this is a CI run (``CI=true``, ``CI=1``; not ``CI=false`` or empty)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_reason(longrepr: Any) -> str:
    """The reason a skip report carries (pytest stores ``(path, line, "Skipped: why")``)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure_text(reason: str) -> str:
    return (f"skipped under CI: {reason}\n(CI is set, so a skip is a failure: install or enable what is missing, "
            f"e.g. `make system-deps` as root; only tests marked `{ALLOWED_MARKER}` may skip)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if (report.skipped and not hasattr(report, "wasxfail") and under_ci()
            and item.get_closest_marker(ALLOWED_MARKER) is None):
        report.outcome = "failed"
        report.longrepr = _failure_text(skip_reason(report.longrepr))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    """A whole module skipped while it was imported (``pytest.importorskip`` at module level)."""
    report = yield
    if report.skipped and under_ci():
        report.outcome = "failed"
        report.longrepr = _failure_text(skip_reason(report.longrepr))
    return report


def suite_of(nodeid: str) -> str:
    """``tests/cluster/test_faults.py::test_x`` -> ``tests/cluster``; a top-level test file is its own suite."""
    path = Path(nodeid.split("::", 1)[0])
    parts = path.parts
    return "/".join(parts[:2]) if len(parts) > 2 else str(path)


def summary_line(reports: list[Any]) -> str | None:
    """One line naming each suite with skipped tests, how many, and why (the commonest reason first)."""
    if not reports:
        return None
    by_suite: dict[str, Counter[str]] = defaultdict(Counter)
    for report in reports:
        if hasattr(report, "wasxfail"):
            continue
        by_suite[suite_of(report.nodeid)][skip_reason(report.longrepr)] += 1
    if not by_suite:
        return None
    parts = []
    for suite in sorted(by_suite):
        reasons = by_suite[suite]
        why = "; ".join(f"{n} {reason}" if len(reasons) > 1 else reason for reason, n in reasons.most_common())
        parts.append(f"{suite} ({sum(reasons.values())}: {why})")
    return f"skipped: {', '.join(parts)}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    line = summary_line(terminalreporter.stats.get("skipped", []))
    if line is not None:
        terminalreporter.write_line(line, yellow=True, bold=True)
