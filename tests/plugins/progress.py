"""A failure named the moment it happens, not only in the summary at the end of a 20-minute run.

With ``-v`` (``make test``) pytest prints each test's name as it starts, so the log always shows what is
running; this adds, under a failed test's line, what failed (the exception's one-line message), so a CI log
read while the run goes on says which test failed and why without waiting for the final report.
"""

from __future__ import annotations

from typing import Any

import pytest


def first_line(report: Any) -> str:
    """The one-line cause of a failed report: the crash message's first line, else the report's last line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    line = lines[0] if crash is not None else lines[-1]
    return line if len(line) <= 300 else line[:297] + "..."


class FailureLines:
    """Writes the one-line cause under each failed test (and each module that failed to import)."""

    def __init__(self, reporter: Any) -> None:
        self.reporter = reporter

    @pytest.hookimpl(trylast=True)  # after the terminal reporter wrote the test's own line
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            phase = "" if report.when == "call" else f" in {report.when}"
            self.reporter.write_line(f"FAILED{phase} {report.nodeid}: {first_line(report)}", red=True)

    @pytest.hookimpl(trylast=True)
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.reporter.write_line(f"ERROR collecting {report.nodeid}: {first_line(report)}", red=True)


@pytest.hookimpl(trylast=True)  # after the terminal plugin registered its reporter
def pytest_configure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # none with -p no:terminal
        config.pluginmanager.register(FailureLines(reporter), "hora-failure-lines")
