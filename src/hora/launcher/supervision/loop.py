"""The one run loop of every job hora supervises, as torch's elastic agent keeps one loop: ``hora run``'s fixed and
elastic drivers, ``hora.run(fn)``, and the drivers of ``hora.ray`` and ``hora.spark``. What they share lives
here; what differs is a handful of public steps each driver defines.

:class:`JobLoop` owns the handles on the job's processes, the event queue their watchers fill, the console,
Ctrl-C and the end of the job:

* ``run()``: the output lock, :meth:`set_up` (before any signal handler: the store, preflight), the signal
  handlers, :meth:`start` then the loop, and whatever happens, every handle shut down and the console closed;
  then :meth:`wrap_up` and the exit status.
* the loop: one event at a time (a burst drained before the next look), the console flushed when idle, a
  ping to every handle every :data:`PING_INTERVAL`, :meth:`look` while the job runs, and past the stop deadline
  every handle killed. It ends when :meth:`over` says so.
* a signal: the first stops every process (SIGTERM, then SIGKILL after the grace), a second kills at once.
* the exit status: processes the grace ran out on are named, then the job's failure (:meth:`failed_status`),
  an interrupt (128 + the signal), or the driver's own verdict (:meth:`final_status`).

The steps a driver defines: :meth:`set_up`, :meth:`start`, :meth:`look`, :meth:`over`, :meth:`wait_s`,
:meth:`on_message`, :meth:`on_handle_gone`, :meth:`on_event` (the driver's own events), :meth:`processes`,
:meth:`killed_label`, :meth:`failed_status`, :meth:`final_status`, :meth:`after_loop`, :meth:`wrap_up` and
:meth:`stop`. What a driver calls: :meth:`start_store`, :meth:`start_agent` (or :meth:`watch` for a handle of its
own), :meth:`stop_all`, :meth:`kill_all` and :attr:`stopping`.

A handle (:class:`Handle`) is whatever runs a batch of the job's processes and reports on them: an agent on a host
(:class:`~hora.launcher.remote.agent_handle.AgentHandle`), Ray actors (``hora.ray.actors``), a Spark stage
(``hora.spark.runner``). It turns what happens into events: ``("msg", index, message)`` (the protocol messages of
:mod:`hora.protocol.messages`: ``started``, ``out``, ``exit``, ``probe``, ``done``), ``("eof", index, code)`` when
it has ended, and ``("agent_err", index, line)``.
"""

from __future__ import annotations

import abc
import datetime
import errno
import logging
import queue
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from hora.common import env as hora_env
from hora.errors import SetupError
from hora.launcher import envvars, output, procs
from hora.launcher.config import RunConfig
from hora.launcher.output_lock import OutputLock, lock_paths
from hora.launcher.remote.agent_handle import AgentHandle, default_transport
from hora.launcher.remote.transport import Transport, agent_argv
from hora.launcher.supervision.root_cause import RankState
from hora.protocol import messages as protocol
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore

log = logging.getLogger(__name__)

PROGRESS_LIVE, PROGRESS_PLAIN = 0.25, 1.0  # seconds between a progress bar's forwarded states
SHUTDOWN_WAIT_S = 5.0  # at the end, how long handles get to finish on their own before they are killed
KILL_WAIT_S = 3.0  # when killing at once, how long handles get to end before they are killed outright
PING_INTERVAL = 2.0  # seconds between the driver's pings to each handle
KILL_AFTER_GRACE = 10.0  # after grace + this, handles that still have not finished are killed


class Handle(Protocol):
    """What the loop supervises: a batch of the job's processes started together, and how to reach them."""

    index: int  # its place in :attr:`JobLoop.handles`; its events carry it
    host: str
    remote: bool  # reached over the network: its end may be a lost host, and others may follow within a keep-alive
    ranks: list[int]  # the numbers of its processes
    started: bool  # its processes started (a ``started`` message came)
    finished: bool  # it said it is done, or its output ended

    def watch(self, events: queue.SimpleQueue[tuple[str, int, Any]]) -> None:
        """Start turning what happens to its processes into events on ``events``."""

    def send(self, message: dict[str, Any]) -> None:
        """An order (``stop``, ``probe``, ``ping``); one that does not apply to it is ignored."""

    def close(self) -> None:
        """No more orders: its processes that still run stop and it ends."""

    def running(self) -> bool:
        """It has not ended yet."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for it to end; True if it did."""

    def kill(self) -> None:
        """End it now, with whatever still runs."""

    def lost(self, code: int, who: str) -> str:
        """How the processes ``who`` ended, when it ended (with ``code``) before they did."""


def record_exit(state: RankState, message: dict[str, Any]) -> None:
    """A handle's ``exit`` message about one process, into that process's state."""
    state.done, state.code, state.sig = True, message.get("code"), message.get("sig")
    state.stopped = bool(message.get("stopped"))
    state.killed = float(message.get("killed") or 0.0)
    state.raised = message.get("raised") or None
    if message.get("oom"):  # the agent found the kernel's OOM killer behind the SIGKILL
        state.how = f"{message['oom']}, {procs.describe_exit(state.code, state.sig)}"
    elif message.get("how"):  # a cluster framework's own account of the end (hora.ray: the actor died, raised ...)
        state.how = str(message["how"])
    state.exit_ts = float(message.get("ts") or time.time())


_STORE_ERROR = re.compile(r"name: (\w+), message: (.+)$")


def listen(addr: str, timeout_s: float) -> Any:
    """Start the job's rendezvous ``TCPStore`` on ``addr`` only, on a port the system picks
    (:func:`hora.common.rendezvous.serve`). It outlives every worker, which elastic jobs need. Imports torch, the
    launch side's only torch import, here so that usage errors and ``--help`` answer without it.

    Raises:
        SetupError: (exit code 2; nothing was started) it cannot listen, as one line naming the address.
    """
    from hora.common import rendezvous

    try:
        return rendezvous.serve(addr, 0, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        found = _STORE_ERROR.search(text)
        name, reason = (found.group(1), found.group(2)) if found else ("", text)
        if isinstance(exc, OSError) and exc.errno is not None and exc.errno in errno.errorcode and exc.strerror:
            name, reason = errno.errorcode[exc.errno], exc.strerror[:1].lower() + exc.strerror[1:]
        hint = {
            "EADDRINUSE": "no free port: every port of net.ipv4.ip_local_port_range is taken on this machine; "
                          "close what holds them, or widen the range",
            "EADDRNOTAVAIL": "that address is not on this machine; pass --network-interface",
        }.get(name, "check this machine's network settings, or pass --network-interface")
        raise SetupError(f"cannot start the rendezvous store for the workers to reach at {addr} (on a port the "
                         f"system picks): {reason}; {hint}") from None


class JobLoop(abc.ABC):
    """The run loop and what every driver shares (see the module docstring).

    Args:
        cfg: the checked job.
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the job's store (a :class:`~hora.protocol.signedstore.SignedStore`) before any
            worker starts (``hora.run`` puts the function there).
    """

    noun = "rank"  # what the driver's lines call one process of the job

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None,
                 store_ready: Callable[[Any], None] | None = None) -> None:
        self.cfg = cfg
        self.transport_for = transport_for or default_transport(cfg)
        self.store_ready = store_ready
        self.store: Any = None  # the job's SignedStore once it listens
        self.addr, self.port = "", 0  # where the store listens
        self.job_id = uuid.uuid4().hex[:12]
        self.secret = JobSecret.generate()  # to the agents on stdin, to the processes in their own environment only
        self.events: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self.handles: list[Handle] = []
        self.console = output.Console(prefix_timestamp=cfg.prefix_timestamp, output_dir=cfg.output_filename)
        self.interrupted: int | None = None
        self._signals = 0  # interrupts received; read while shutting down, when no event loop runs
        self._stop_deadline: float | None = None

    # --- the steps a driver defines ---------------------------------------------------------------------
    @abc.abstractmethod
    def set_up(self) -> None:
        """Before any signal handler is installed: what must stand before a process starts (the store)."""

    def start(self) -> None:
        """First thing under the signal handlers (the fixed driver starts its agents here)."""
        return None  # nothing to do by default

    @abc.abstractmethod
    def look(self, now: float) -> None:
        """One look at the job between events, once per turn of the loop."""

    @abc.abstractmethod
    def over(self) -> bool:
        """The job is over: the loop ends."""

    def wait_s(self) -> float:
        """How long the loop waits for an event before the next look."""
        return 0.5

    @abc.abstractmethod
    def on_message(self, handle: Handle, message: dict[str, Any]) -> None:
        """A message from ``handle`` other than a worker's line or the handle's start and end (a process's exit,
        a probe's answer)."""

    @abc.abstractmethod
    def on_handle_gone(self, handle: Handle, code: int) -> None:
        """``handle`` ended (its agent exited with ``code``)."""

    def on_event(self, kind: str, value: Any) -> None:
        """An event of the driver's own (the elastic driver's discovery results)."""
        log.debug("unexpected event %s: %r", kind, value)

    @abc.abstractmethod
    def processes(self) -> Iterable[RankState]:
        """Every process of the job, ended or not."""

    @abc.abstractmethod
    def killed_label(self, state: RankState) -> str:
        """How the line about a process the grace ran out on names it."""

    @abc.abstractmethod
    def failed_status(self) -> int | None:
        """When the job failed: say why in one line and return its exit status; else None."""

    def final_status(self) -> int:
        """The exit status of a job that neither failed nor was interrupted."""
        return 0

    def after_loop(self) -> None:
        """Right after the loop ended without an exception, before the handles are shut down."""
        return None  # nothing to do by default

    def wrap_up(self) -> None:
        """After every handle was shut down, when the loop ended without an exception."""
        return None  # nothing to do by default

    def stop(self) -> None:
        """When the loop ends, however: stop the driver's own threads."""
        return None  # nothing to do by default

    # --- running ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; return the exit status for the ``hora run`` process."""
        outputs = OutputLock.hold(lock_paths(self.cfg.output_filename, self.cfg.timeline_filename), self.job_id)
        previous = {}
        try:
            self.set_up()
            if threading.current_thread() is threading.main_thread():  # signal handlers live there only
                previous = {s: signal.signal(s, self._on_signal) for s in procs.stop_signals()}
            try:
                self.start()
                self._loop()
                self.after_loop()
            finally:
                self.stop()
                self._shut_down()  # Ctrl-C still reaches _on_signal here: it kills, never aborts
                self.console.close()
            self.wrap_up()
            return self._exit_status()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            outputs.release()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.events.put(("signal", -1, signum))

    def _loop(self) -> None:
        last_ping = time.monotonic()
        while not self.over():
            try:
                self._handle(*self.events.get(timeout=self.wait_s()))
                while True:  # a burst of output: drain it before the next look
                    self._handle(*self.events.get_nowait())
            except queue.Empty:
                self.console.flush()
            now = time.monotonic()
            if self._stop_deadline is not None and now > self._stop_deadline:
                self.kill_all()
                return
            self.look(now)
            if now - last_ping >= PING_INTERVAL:
                last_ping = now
                for handle in self.handles:
                    if not handle.finished:
                        handle.send({"t": protocol.PING})

    def _handle(self, kind: str, index: int, value: Any) -> None:
        if kind == "msg":
            message = value
            handle = self.handles[index]
            if message["t"] == protocol.OUT:
                self.console.worker_line(int(message["r"]), message["s"], message["l"], message.get("ts"),
                                         message.get("k", protocol.LINE))
            elif message["t"] == protocol.STARTED:
                handle.started = True
                log.info("host %s (%s) started processes %s", handle.host, message.get("hostname"), handle.ranks)
            elif message["t"] == protocol.DONE:
                handle.finished = True
            else:
                self.on_message(handle, message)
        elif kind == "eof":
            self.handles[index].finished = True
            self.on_handle_gone(self.handles[index], value)
        elif kind == "agent_err":
            output.note(f"host {self.handles[index].host}: {value}")
        elif kind == "signal":
            self._on_interrupt(value)
        else:
            self.on_event(kind, value)

    # --- the store and the handles ---------------------------------------------------------------------
    def start_store(self, addr: str) -> SignedStore:
        """Serve the job's rendezvous store on ``addr`` (see :func:`listen`); every value in it authenticated with
        the job's secret (:class:`~hora.protocol.signedstore.SignedStore`); ``store_ready`` gets it."""
        raw = listen(addr, max(self.cfg.start_timeout, 60))
        self.addr, self.port = addr, int(raw.port)
        self.store = SignedStore(raw, self.secret, self.job_id, f"{addr}:{self.port}")
        if self.store_ready is not None:
            self.store_ready(self.store)
        log.info("rendezvous store on %s:%d (job %s)", addr, self.port, self.job_id)
        return self.store

    def agent_spec(self, host: str, workers: list[dict[str, Any]], unset: Iterable[str] = ()) -> dict[str, Any]:
        """The ``spec`` message that starts an agent's ``workers`` (each ``{"rank": n, "env": {...}}``)."""
        base = envvars.forwarded(hora_env.launcher_environ(), self.cfg.env)
        if self.cfg.network_interfaces:
            base.setdefault("GLOO_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
            base.setdefault("NCCL_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
        return {"t": "spec", "command": list(self.cfg.command), "cwd": self.cfg.cwd, "env": base,
                "unset": [*envvars.RANK_VARIABLES, *unset], "workers": workers, "store_addr": self.addr,
                "secret": self.secret.hex(), "heartbeat_timeout": self.cfg.heartbeat_timeout, "host": host,
                # a live bar on a terminal is redrawn 4 times a second; plain lines come at most once a second
                "progress_interval": PROGRESS_LIVE if self.console.live else PROGRESS_PLAIN}

    def start_agent(self, host: str, is_local: bool, numbers: list[int], spec: dict[str, Any]) -> AgentHandle:
        """Start the agent of ``host`` for the processes ``numbers`` and send it ``spec``."""
        try:
            proc = self.transport_for(host, is_local).start(host, agent_argv(self.cfg.python), self.cfg.cwd)
        except OSError as exc:  # e.g. no ssh client installed
            raise SetupError(f"host {host}: cannot start its agent ({exc.strerror or exc}); "
                             "install openssh-client or check the Python path") from None
        agent = AgentHandle(len(self.handles), host, proc, numbers, remote=not is_local)
        agent.send(spec)
        self.watch(agent)
        return agent

    def watch(self, handle: Handle) -> None:
        """Supervise ``handle`` (its ``index`` is its place in :attr:`handles`): its events come to the loop."""
        assert handle.index == len(self.handles), (handle.index, len(self.handles))
        self.handles.append(handle)
        handle.watch(self.events)

    # --- the end ---------------------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """Every process was told to stop (the job failed, or was interrupted): nothing new starts."""
        return self._stop_deadline is not None

    def stop_all(self) -> None:
        """Tell every handle to stop its processes (SIGTERM, SIGKILL after the grace); past the grace and
        :data:`KILL_AFTER_GRACE`, the loop kills what is left (:meth:`kill_all`)."""
        if self._stop_deadline is None:
            for handle in self.handles:
                handle.send({"t": protocol.STOP, "grace": self.cfg.grace})
            self._stop_deadline = time.monotonic() + self.cfg.grace + KILL_AFTER_GRACE

    def kill_all(self) -> None:
        """End every handle now: closed, and killed if it lingers past :data:`KILL_WAIT_S`; processes that had not
        ended count as stopped (exit code 1)."""
        for state in self.processes():
            if not state.done:
                state.done, state.code, state.stopped = True, 1, True
        for handle in self.handles:
            handle.close()
        deadline = time.monotonic() + KILL_WAIT_S
        for handle in self.handles:
            if not handle.wait(deadline - time.monotonic()):
                handle.kill()

    def _on_interrupt(self, signum: int) -> None:
        running = sum(1 for p in self.processes() if not p.done)
        if self.interrupted is not None or self._stop_deadline is not None:
            if self.interrupted is None:
                self.interrupted = signum
            output.note(f"interrupted again: killing the {running} {self.noun}(s) still running now (SIGKILL)"
                        if running else f"interrupted again: every {self.noun} has already exited; finishing")
            self.kill_all()
            return
        self.interrupted = signum
        again = "; press Ctrl-C again to kill them now" if signum == signal.SIGINT else ""
        output.note(f"interrupted ({procs.stop_reason(signum)}): stopping {running} {self.noun}(s) "
                    f"(SIGTERM, SIGKILL after {self.cfg.grace:g}s{again})")
        self.stop_all()

    def _shut_down(self) -> None:
        """Let every handle finish (closed, its processes stop); an interrupt here kills at once."""
        for handle in self.handles:
            handle.close()
        signals = self._signals
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while time.monotonic() < deadline and any(h.running() for h in self.handles):
            if self._signals != signals:
                break
            time.sleep(0.05)
        if self._signals != signals:
            output.note("interrupted while the hosts finished: killing their agents now (SIGKILL)")
        for handle in self.handles:
            if handle.running():
                handle.kill()

    def _exit_status(self) -> int:
        killed = [p for p in self.processes() if p.killed]
        if killed:
            output.note(output.grace_ran_out([self.killed_label(p) for p in killed], max(p.killed for p in killed)))
        failed = self.failed_status()
        if failed is not None:
            return failed
        if self.interrupted is not None:
            status = 128 + self.interrupted
            output.note(f"stopped after {procs.signal_name(self.interrupted)}: no {self.noun} is running; "
                        f"exit code {status}")
            return status
        return self.final_status()
