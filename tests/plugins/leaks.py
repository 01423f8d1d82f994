"""No process left behind: a test whose processes outlive it fails.

A process a test started and never waited for keeps running into the next tests (competing for the 2 cores,
holding ports and files) and, once its ``Popen`` is collected, prints ``ResourceWarning: subprocess ... is still
running`` far from the test that leaked it. So after each test's teardown this plugin looks at the pytest
process's descendants: any that appeared while the test body ran and are still there (after a short grace, for
processes already on their way out) are named in a failure of that test, then killed.

Processes made during set-up belong to fixtures (a session's cluster, the fork harness's store) and are not
counted; helpers meant to live for the session say so in their command line (:data:`SESSION_HELPERS`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.polling import wait_until

GRACE_S = 10.0  # a process already told to stop gets this long to go (polled: no cost when none is left);
# the ini option leak_grace_s overrides it
# command-line fragments of processes made to outlive one test: Python's multiprocessing helpers and the fork
# harness's rendezvous store (src/hora/testing.py), each started on first use and ending with the session
SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "hora.testing: session store")

_BEFORE = pytest.StashKey[dict[tuple[int, int], "Proc"]]()


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks after boot: a pid reused by a later process is another Proc
    state: str  # "Z": exited, never waited for
    cmdline: str

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)

    def describe(self) -> str:
        what = self.cmdline if len(self.cmdline) <= 160 else self.cmdline[:157] + "..."
        return f"pid {self.pid}{' (exited, never waited for)' if self.state == 'Z' else ''}: {what}"


def _read(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip() or stat[stat.index("(") : stat.rindex(")") + 1]
    return Proc(pid, int(fields[19]), fields[0], cmdline)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(root: int | None = None) -> dict[tuple[int, int], Proc]:
    """Every live (or unreaped) descendant of ``root`` (this process by default)."""
    out: dict[tuple[int, int], Proc] = {}
    todo = _children(os.getpid() if root is None else root)
    while todo:
        pid = todo.pop()
        proc = _read(pid)
        if proc is None:
            continue
        out[proc.key] = proc
        todo += _children(pid)
    return out


def _helper(proc: Proc) -> bool:
    return any(marker in proc.cmdline for marker in SESSION_HELPERS)


def new_processes(before: dict[tuple[int, int], Proc], grace_s: float = GRACE_S) -> list[Proc]:
    """Descendants not in ``before`` (nor session helpers), after waiting up to ``grace_s`` for them to end."""
    left: list[Proc] = []

    def settled() -> bool:
        left[:] = [p for key, p in descendants().items() if key not in before and not _helper(p)]
        # zombies: only a wait() ends those, and nobody is going to call it
        return all(p.state == "Z" for p in left)

    wait_until(settled, timeout=grace_s, step=0.05)
    return left


def kill(procs: list[Proc]) -> None:
    """SIGKILL each process and its own descendants; reap those that are this process's children."""
    doomed: dict[tuple[int, int], Proc] = {}
    for proc in procs:
        doomed[proc.key] = proc
        doomed.update(descendants(proc.pid))
    for proc in doomed.values():
        current = _read(proc.pid)
        if current is not None and current.start == proc.start:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in doomed.values():
        try:
            os.waitpid(proc.pid, 0)
        except ChildProcessError:  # not our child (its parent reaps it), or already reaped
            pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("leak_grace_s", f"seconds a test's leftover processes get to end (default {GRACE_S:g})",
                  default=str(GRACE_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    item.stash[_BEFORE] = descendants()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    result = yield
    before = item.stash.get(_BEFORE, None)
    if before is None:  # the test body never ran (set-up failed or skipped)
        return result
    left = new_processes(before, float(item.config.getini("leak_grace_s")))
    if left:
        kill(left)
        listed = "\n  ".join(p.describe() for p in left)
        pytest.fail(f"this test left {len(left)} process{'es' if len(left) > 1 else ''} behind (killed now):\n  "
                    f"{listed}\nwait for every process a test starts (proc.wait() after proc.kill(), or a "
                    "`with subprocess.Popen(...)` block), also when the test fails", pytrace=False)
    return result
