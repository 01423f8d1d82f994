"""The one run loop of a ``hora run`` job, fixed or elastic, as torch's elastic agent keeps one loop: what the two
drivers share lives here, what differs is a handful of steps each driver defines.

:class:`JobLoop` owns the agents, the event queue their pumps fill, the console, Ctrl-C and the end of the job:

* ``run()``: the output lock, :meth:`set_up` (before any signal handler: the store, preflight), the signal
  handlers, :meth:`start` then the loop, and whatever happens, every agent shut down and the console closed;
  then :meth:`wrap_up` and the exit status.
* the loop: one event at a time (a burst drained before the next look), the console flushed when idle, a
  ping to every agent every :data:`~hora.launcher.remote.agent_handle.PING_INTERVAL`, :meth:`look` while the job
  runs, and past the stop deadline every agent killed. It ends when :meth:`over` says so.
* a signal: the first stops every process (SIGTERM, then SIGKILL after the grace), a second kills at once.
* the exit status: processes the grace ran out on are named, then the job's failure (:meth:`failed_status`),
  an interrupt (128 + the signal), or the driver's own verdict (:meth:`final_status`).

The steps a driver defines: :meth:`set_up`, :meth:`start`, :meth:`look`, :meth:`over`, :meth:`wait_s`,
:meth:`on_message`, :meth:`on_agent_gone`, :meth:`on_event` (the driver's own events), :meth:`processes`,
:meth:`killed_label`, :meth:`failed_status`, :meth:`final_status`, :meth:`after_loop`, :meth:`wrap_up` and
:meth:`stop`.
"""

from __future__ import annotations

import abc
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from hora.common import env as hora_env
from hora.errors import SetupError
from hora.launcher import envvars, output, procs
from hora.launcher.config import RunConfig
from hora.launcher.failures import RankState
from hora.launcher.output_lock import OutputLock, lock_paths
from hora.launcher.remote.agent_handle import (
    PING_INTERVAL,
    AgentHandle,
    default_transport,
    force_kill,
    start_pumps,
    stop_agents,
)
from hora.launcher.remote.transport import Transport, agent_argv
from hora.protocol import messages as protocol
from hora.protocol.jobsecret import JobSecret

log = logging.getLogger(__name__)

PROGRESS_LIVE, PROGRESS_PLAIN = 0.25, 1.0  # seconds between a progress bar's forwarded states
SHUTDOWN_WAIT_S = 5.0  # at the end, how long agents get to finish on their own before they are killed


def record_exit(state: RankState, message: dict[str, Any]) -> None:
    """An agent's ``exit`` message about one process, into that process's state."""
    state.done, state.code, state.sig = True, message.get("code"), message.get("sig")
    state.stopped = bool(message.get("stopped"))
    state.killed = float(message.get("killed") or 0.0)
    if message.get("oom"):  # the agent found the kernel's OOM killer behind the SIGKILL
        state.how = f"{message['oom']}, {procs.describe_exit(state.code, state.sig)}"
    elif message.get("how"):  # a cluster framework's own account of the end (hora.ray: the actor died, raised ...)
        state.how = str(message["how"])
    state.exit_ts = float(message.get("ts") or time.time())


class JobLoop(abc.ABC):
    """The run loop and what both drivers share (see the module docstring).

    Args:
        cfg: the checked job.
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the job's store (a :class:`~hora.protocol.signedstore.SignedStore`) before any
            worker starts (``hora.run`` puts the function there).
    """

    noun = "rank"  # what the launcher's lines call one process of the job

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
        self.agents: list[AgentHandle] = []
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
    def on_message(self, agent: AgentHandle, message: dict[str, Any]) -> None:
        """A message from ``agent`` other than a worker's line or the agent's start and end (a process's exit, a
        probe's answer)."""

    @abc.abstractmethod
    def on_agent_gone(self, agent: AgentHandle, code: int) -> None:
        """``agent``'s output ended (it exited with ``code``)."""

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
        """Right after the loop ended without an exception, before the agents are shut down."""
        return None  # nothing to do by default

    def wrap_up(self) -> None:
        """After every agent was shut down, when the loop ended without an exception."""
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
                self._shutdown_agents()  # Ctrl-C still reaches _on_signal here: it kills, never aborts
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
                self._force_kill()
                return
            self.look(now)
            if now - last_ping >= PING_INTERVAL:
                last_ping = now
                for agent in self.agents:
                    if not agent.finished:
                        agent.send({"t": protocol.PING})

    def _handle(self, kind: str, index: int, value: Any) -> None:
        if kind == "msg":
            message = value
            agent = self.agents[index]
            if message["t"] == protocol.OUT:
                self.console.worker_line(int(message["r"]), message["s"], message["l"], message.get("ts"),
                                         message.get("k", protocol.LINE))
            elif message["t"] == protocol.STARTED:
                agent.started = True
                log.info("host %s (%s) started processes %s", agent.host, message.get("hostname"), agent.ranks)
            elif message["t"] == protocol.DONE:
                agent.finished = True
            else:
                self.on_message(agent, message)
        elif kind == "eof":
            self.agents[index].finished = True
            self.on_agent_gone(self.agents[index], value)
        elif kind == "agent_err":
            output.note(f"host {self.agents[index].host}: {value}")
        elif kind == "signal":
            self._on_interrupt(value)
        else:
            self.on_event(kind, value)

    # --- agents ----------------------------------------------------------------------------------------
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

    def start_agent(self, index: int, host: str, is_local: bool, numbers: list[int],
                    spec: dict[str, Any]) -> AgentHandle:
        """Start the agent of ``host`` for the processes ``numbers`` and send it ``spec``."""
        try:
            proc = self.transport_for(host, is_local).start(host, agent_argv(self.cfg.python), self.cfg.cwd)
        except OSError as exc:  # e.g. no ssh client installed
            raise SetupError(f"host {host}: cannot start its agent ({exc.strerror or exc}); "
                             "install openssh-client or check the Python path") from None
        agent = AgentHandle(index, host, proc, numbers)
        self.agents.append(agent)
        agent.send(spec)
        start_pumps(agent, self.events)
        return agent

    # --- the end ---------------------------------------------------------------------------------------
    def _on_interrupt(self, signum: int) -> None:
        running = sum(1 for p in self.processes() if not p.done)
        if self.interrupted is not None or self._stop_deadline is not None:
            if self.interrupted is None:
                self.interrupted = signum
            output.note(f"interrupted again: killing the {running} {self.noun}(s) still running now (SIGKILL)"
                        if running else f"interrupted again: every {self.noun} has already exited; finishing")
            self._force_kill()
            return
        self.interrupted = signum
        again = "; press Ctrl-C again to kill them now" if signum == signal.SIGINT else ""
        output.note(f"interrupted ({procs.stop_reason(signum)}): stopping {running} {self.noun}(s) "
                    f"(SIGTERM, SIGKILL after {self.cfg.grace:g}s{again})")
        self._stop_all()

    def _stop_all(self) -> None:
        if self._stop_deadline is None:
            self._stop_deadline = stop_agents(self.agents, self.cfg.grace)

    def _force_kill(self) -> None:
        """Kill every agent (see :func:`force_kill`); processes that had not ended count as stopped."""
        force_kill(self.agents, self.processes())

    def _shutdown_agents(self) -> None:
        """Let every agent finish (closing its stdin stops its workers); an interrupt here kills at once."""
        for agent in self.agents:
            agent.close_stdin()
        signals = self._signals
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while time.monotonic() < deadline and any(a.proc.poll() is None for a in self.agents):
            if self._signals != signals:
                break
            time.sleep(0.05)
        if self._signals != signals:
            output.note("interrupted while the hosts finished: killing their agents now (SIGKILL)")
        for agent in self.agents:
            if agent.proc.poll() is None:
                procs.signal_groups([agent.proc.pid], signal.SIGKILL)
                agent.proc.wait()

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
