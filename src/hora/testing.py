"""Run a function on N fork-started ranks with real process groups: the one fork harness of hora's tests
(``tests/distributed``) and benchmarks (``benchmarks/common.py``), usable for your own tests too.

The parent (a pytest process, a benchmark) never initialises a process group, and never runs c10d threads:
the rendezvous store (what ``hora run``'s driver hosts) lives in a separate store process, started once per
session, because a child forked while the store's server thread holds a c10d lock would deadlock creating its
own client. The parent gives each child the launcher's variables (``HORA_RANK`` ...), so ``hora.init()`` in
a child takes the same path as under the real launcher; every job has its own key prefix (``HORA_JOB_ID``)
and, as under ``hora run``, its own secret (``HORA_SECRET``; ``env={"HORA_SECRET": None}`` runs without).

Each rank reports its return value, or its exception with traceback and wall-clock time. On failure one
AssertionError shows the earliest failure first (a follow-on Gloo error on another rank can mask the root
cause), then the others, then the ranks that hung. A deadline SIGKILLs hung ranks' process groups.

Example:
    >>> import hora as hvd, torch
    >>> def fn(rank, size):
    ...     return hvd.allreduce(torch.tensor([rank]), op=hvd.Sum).item()
    >>> run_ranks(fn, 2)  # doctest: +SKIP
    [1, 1]
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import itertools
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

# torch._dynamo is imported once here, in the parent: each forked rank that builds its first torch.optim
# optimizer would otherwise import it itself (torch.optim does, lazily), seconds per rank
import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist

import hora
import hora._public  # noqa: F401 - every public module, once here: each forked rank would import them itself
from hora.protocol.code_fingerprint import code_fingerprint, installed_version
from hora.protocol.jobsecret import ENV_SECRET, JobSecret

# After one rank fails, the others get this long to report (their own error or a follow-on one).
FAILURE_GRACE_S = 3.0
_calls = itertools.count()
_store_server: subprocess.Popen[str] | None = None
_store_port = 0

_STORE_SERVER = (
    "# hora.testing: session store (lives as long as the process that started it)\n"
    "import sys, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()  # serve until the test session (our stdin's writer) ends\n"
)


def _store() -> int:
    """The port of the session's store process (started on first use; it ends with this process)."""
    global _store_server, _store_port
    if _store_server is None or _store_server.poll() is not None:
        _stop_store()  # a store that died: reap it and close its pipes before starting another
        _store_server = subprocess.Popen([sys.executable, "-c", _STORE_SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        assert _store_server.stdout is not None
        line = _store_server.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the test store process did not start (it said {line!r})")
        _store_port = int(line)
    return _store_port


def _stop_store() -> None:
    """End the store process (its stdin closing is its signal) and close its pipes: at exit nothing is left
    running, and no pipe is left for the garbage collector to warn about."""
    global _store_server
    server, _store_server = _store_server, None
    if server is None:
        return
    for pipe in (server.stdin, server.stdout):
        if pipe is not None:
            pipe.close()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


atexit.register(_stop_store)


@dataclass
class _Report:
    rank: int
    ok: bool
    value: Any = None
    when: float = 0.0  # wall clock (time.time()) of the failure
    text: str = ""


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    init: bool = True,
    threads: int | None = 1,
) -> list[Any]:
    """Run ``fn(rank, size, *args)`` on ``nprocs`` fork-started ranks; return the values in rank order.

    Args:
        fn: runs in each child. With ``init=True`` the harness calls ``hora.init()`` before it and
            ``hora.shutdown()`` after it.
        nprocs: number of ranks.
        timeout: seconds for the whole job; ranks still running then are killed and named.
        env: extra environment for the children; a value of None removes the variable.
        init: whether the harness initialises and shuts down hora around ``fn``.
        threads: torch's intra-op threads in each rank (1: tests share 2 cores among up to 4 ranks); None
            leaves torch's default (benchmarks).

    Raises:
        AssertionError: a rank raised, crashed or hung. The message shows the earliest failure first.
    """
    port = _store()
    stacks = tempfile.mkdtemp(prefix="hora-ranks-")
    job_env = {
        "HORA_SIZE": str(nprocs),
        "HORA_LOCAL_SIZE": str(nprocs),
        "HORA_CROSS_RANK": "0",
        "HORA_CROSS_SIZE": "1",
        "HORA_STORE_ADDR": "127.0.0.1",
        "HORA_STORE_PORT": str(port),
        "HORA_JOB_ID": f"test-{os.getpid()}-{next(_calls)}-{uuid.uuid4().hex[:8]}",
        ENV_SECRET: JobSecret.generate().hex(),
        **(env or {}),
    }
    procs, conns = _start(fn, nprocs, args, job_env, init, threads, stacks)
    try:
        reports, unfinished = _collect(procs, conns, time.monotonic() + timeout)
        where = _where_hung(procs, unfinished, stacks)
    finally:
        for proc in procs:
            if proc.is_alive():
                _kill_group(proc.pid)
            proc.join()
        for conn in conns:
            conn.close()
        shutil.rmtree(stacks, ignore_errors=True)
    failures = sorted((r for r in reports.values() if not r.ok), key=lambda r: r.when)
    if failures or unfinished:
        raise AssertionError(_failure_message(failures, unfinished, nprocs, timeout, where))
    return [reports[rank].value for rank in range(nprocs)]


def _start(fn: Callable[..., Any], nprocs: int, args: tuple, job_env: Mapping[str, str | None], init: bool,
           threads: int | None, stacks: str) -> tuple[list, list[Connection]]:
    ctx = multiprocessing.get_context("fork")
    # what every rank's init() would compute the same way (hora's code fingerprint and version: reads and
    # allocations) is computed once here: a forked child that allocates much may collect garbage it
    # inherited, whose finalizers can wait forever on a lock some thread of this process held at fork time
    code_fingerprint()
    installed_version()
    procs, conns = [], []
    for rank in range(nprocs):
        recv, send = ctx.Pipe(duplex=False)
        rank_env = {"HORA_RANK": str(rank), "HORA_LOCAL_RANK": str(rank), **job_env}
        stack_file = os.path.join(stacks, f"rank{rank}.stack")
        proc = ctx.Process(target=_child, args=(fn, rank, nprocs, args, rank_env, init, threads, send, stack_file),
                           name=f"rank{rank}")
        proc.start()
        send.close()  # the child holds the only sending end: EOF means it is gone
        procs.append(proc)
        conns.append(recv)
    return procs, conns


def _where_hung(procs: list, unfinished: Mapping[int, str], stacks: str) -> dict[int, str]:
    """Every thread's Python stack of each hung rank (faulthandler, on SIGUSR1), before they are killed."""
    for rank in unfinished:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if unfinished:
        time.sleep(0.5)
    where = {}
    for rank in unfinished:
        try:
            with open(os.path.join(stacks, f"rank{rank}.stack")) as f:
                lines = f.read().strip().splitlines()
        except OSError:
            lines = []
        where[rank] = "\n".join(lines[-60:])
    return where


def _child(fn: Callable[..., Any], rank: int, size: int, args: tuple, env: Mapping[str, str | None],
           init: bool, threads: int | None, conn: Connection, stack_file: str) -> None:
    os.setpgrp()  # the deadline kills this rank's whole process group
    # Everything inherited from the parent (a pytest process: torch, the test modules) is never garbage here:
    # frozen, a full collection (hora.shutdown() runs one) skips it instead of touching every object, which
    # would copy the whole inherited heap page by page
    gc.freeze()
    code = 0
    dump = open(stack_file, "w")  # noqa: SIM115 - must stay open for faulthandler until os._exit
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)  # the parent asks where a hung rank is
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if threads is not None:
            torch.set_num_threads(threads)
        if init:
            hora.init()
        value = fn(rank, size, *args)
        if init:
            hora.shutdown()
        payload: tuple = ("ok", value)
    except BaseException:  # noqa: BLE001 - everything, even SystemExit, goes back to the parent
        code = 1
        payload = ("error", time.time(), traceback.format_exc())
    try:
        conn.send(payload)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
        code = 1
        conn.send(("error", time.time(), f"rank {rank}'s result could not be sent back: {exc!r}"))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never run pytest's atexit handlers in a child


def _collect(procs: list, conns: list[Connection], deadline: float) -> tuple[dict[int, _Report], dict[int, str]]:
    """Wait for every rank's report; returns reports and {rank: why it has none} for the rest."""
    reports: dict[int, _Report] = {}
    pending = set(range(len(procs)))
    first_failure: float | None = None
    while pending:
        limit = deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_S)
        left = limit - time.monotonic()
        if left <= 0:
            break
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=left)
        for rank in sorted(pending):
            report = _read(rank, procs[rank], conns[rank])
            if report is None:
                continue
            reports[rank] = report
            pending.discard(rank)
            if not report.ok and first_failure is None:
                first_failure = time.monotonic()
    why = "no result before the deadline (hung?)" if first_failure is None else (
        f"still running {FAILURE_GRACE_S:.0f} s after the first failure")
    return reports, {rank: why for rank in sorted(pending)}


def _read(rank: int, proc: Any, conn: Connection) -> _Report | None:
    if conn.poll():
        try:
            msg = conn.recv()
        except EOFError:  # the child exited without sending
            msg = None
        if msg is not None and msg[0] == "ok":
            return _Report(rank, True, value=msg[1])
        if msg is not None:
            return _Report(rank, False, when=msg[1], text=msg[2])
    elif proc.is_alive() or conn.poll():
        return None  # still running, or its message arrived just now: read it next time round
    proc.join()
    code = proc.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return _Report(rank, False, when=time.time(), text=f"rank {rank} died without reporting ({how})\n")


def _kill_group(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)  # the child may not have called setpgrp yet
        except ProcessLookupError:
            pass


def _failure_message(failures: list[_Report], unfinished: Mapping[int, str], nprocs: int, timeout: float,
                     where: Mapping[int, str]) -> str:
    lines = [f"{len(failures)} of {nprocs} ranks failed, {len(unfinished)} did not finish (timeout {timeout} s)."]
    if failures:
        t0 = failures[0].when
        lines.append(f"Earliest failure first: rank {failures[0].rank}.")
        for rep in failures:
            stamp = time.strftime("%H:%M:%S", time.localtime(rep.when)) + f".{int(rep.when % 1 * 1000):03d}"
            lines.append(f"--- rank {rep.rank} failed at {stamp} (+{rep.when - t0:.3f} s) ---")
            lines.append(rep.text.rstrip())
    for rank, why in unfinished.items():
        lines.append(f"--- rank {rank} hung: {why}; killed with SIGKILL ---")
        if where.get(rank):
            lines.append(f"where rank {rank}'s threads were:\n{where[rank]}")
    if unfinished:
        lines.append(f"hung ranks: {sorted(unfinished)}")
    return "\n".join(lines)


def rank_store() -> dist.Store:
    """A client of the job's rendezvous store, namespaced by job id: a side channel for tests.

    ``rank_store().set("k", "v")`` on one rank, ``rank_store().get("k")`` (blocking) on another.
    """
    base = dist.TCPStore(os.environ["HORA_STORE_ADDR"], int(os.environ["HORA_STORE_PORT"]), is_master=False,
                         wait_for_workers=False)
    return dist.PrefixStore(f"harness/{os.environ['HORA_JOB_ID']}", base)
