"""Processes and signals: own process groups, parent-death signals, stopping groups, naming exits.

Standard library only (the agent imports this).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - exotic libc
        _libc = None


def die_with_parent() -> None:
    """In a child before exec: ask Linux to SIGKILL us when our parent dies (second line of defence).

    The first line is the agent killing its workers' process groups when the driver goes away.
    """
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def child_setup(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: die with the parent; exit at once if the parent is already gone."""

    def setup() -> None:
        die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process group; groups already gone are skipped."""
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_signals() -> list[int]:
    """The signals that stop a job gracefully (the ranks get the grace period): Ctrl-C, a scheduler's SIGTERM,
    and SIGHUP (the terminal closed, the ssh session to the login node dropped) unless the launcher was
    started to ignore it (``nohup``), which keeps the job running."""
    found: list[int] = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        found.append(signal.SIGHUP)
    return found


def stop_reason(signum: int) -> str:
    """What a stop signal usually means, for the launcher's message: ``"SIGHUP: the terminal closed ..."``."""
    if signum == signal.SIGHUP:
        return "SIGHUP: its terminal closed or its ssh session dropped"
    return signal_name(signum)


def signal_name(signum: int) -> str:
    """``9`` -> ``'SIGKILL'``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None, sig: int | None) -> str:
    """Human words for how a process ended: ``exit code 3`` or ``signal SIGKILL (9)``."""
    if sig:
        return f"signal {signal_name(sig)} ({sig})"
    return f"exit code {code}"


def exit_status(code: int | None, sig: int | None) -> int:
    """The shell-style status for an exit: the code, or 128 + signal number."""
    if sig:
        return 128 + sig
    return code if code is not None else 1


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux): a process a worker starts in a new
    session, whose parent then exits, is re-parented here instead of to init, so :func:`descendants` still
    finds it and the job's end can stop it."""
    if _libc is None:
        return False
    return bool(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process this one can see (from /proc/<pid>/stat)."""
    found: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1:
            found[int(name)] = int(fields[1])
    return found


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first, then theirs), whatever its session or group."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def signal_pids(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process; those already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# x86-64 and aarch64 numbers of the system calls a stuck process is usually found in
_SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 7: "poll", 23: "select", 35: "nanosleep", 45: "recvfrom", 61: "wait4",
               202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6", 271: "ppoll",
               281: "epoll_pwait", 44: "sendto", 46: "sendmsg", 47: "recvmsg", 17: "pread64", 74: "fsync"},
    "aarch64": {63: "read", 64: "write", 73: "ppoll", 72: "pselect6", 101: "nanosleep", 115: "clock_nanosleep",
                98: "futex", 22: "epoll_pwait", 207: "recvfrom", 206: "sendto", 260: "wait4", 82: "fsync"},
}
_STATES = {
    "R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped by a debugger",
    "Z": "exited (a zombie)", "X": "dead", "I": "idle",
}


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def process_state(pid: int) -> dict[str, str]:
    """What /proc says about ``pid`` from outside it: ``state`` (a letter), ``syscall`` (the system call its
    main thread is in, ``"running"`` in user space, or ``""``), ``wchan`` (the kernel function it sleeps in)
    and ``threads_running`` (how many of its threads are on a CPU)."""
    status = _read(f"/proc/{pid}/status")
    state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "")
    raw = _read(f"/proc/{pid}/syscall").split()
    syscall = ""
    if raw:
        if raw[0] == "running":
            syscall = "running"
        elif raw[0].lstrip("-").isdigit() and int(raw[0]) >= 0:
            number = int(raw[0])
            syscall = _SYSCALLS.get(os.uname().machine, {}).get(number, f"#{number}")
    wchan = _read(f"/proc/{pid}/wchan")
    running = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = _read(f"/proc/{pid}/task/{tid}/stat")
            if stat[stat.rfind(")") + 2 :][:1] == "R":
                running += 1
    except OSError:
        pass
    return {"state": state, "syscall": syscall, "wchan": "" if wchan == "0" else wchan,
            "threads_running": str(running)}


def describe_state(info: dict[str, str]) -> str:
    """Words for :func:`process_state`'s answer, e.g. ``stopped (state T: SIGSTOP, Ctrl-Z or a debugger) ...``."""
    state = info.get("state", "")
    if not state:
        return "its process is gone"
    if state in ("T", "t"):
        return (f"its process is {_STATES[state]} (state {state}: SIGSTOP, Ctrl-Z or a debugger); it cannot run "
                "until it gets SIGCONT")
    if state == "Z":
        return "its process has exited (a zombie, not yet reaped)"
    syscall, wchan = info.get("syscall", ""), info.get("wchan", "")
    busy = int(info.get("threads_running", "0") or 0)
    if state == "R" or syscall == "running":
        return (f"its process is running ({busy or 1} thread(s) on a CPU) but does not answer: busy in native code "
                "that holds the Python GIL (a long C/C++/CUDA call) or an endless native loop")
    where = f"in the {syscall} system call" if syscall and syscall != "running" else "in the kernel"
    kernel = f" (kernel: {wchan})" if wchan else ""
    if state == "D":
        return f"its process is blocked in uninterruptible I/O {where}{kernel}: a hung filesystem or device"
    return (f"its process is {_STATES.get(state, 'in state ' + state)} {where}{kernel}: inside a native call that "
            "does not return while holding the Python GIL, or cut off from its peers by the network")
