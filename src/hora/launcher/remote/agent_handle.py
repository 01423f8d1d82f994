"""The driver's side of an agent: its process and stdin (:class:`AgentHandle`), how it is reached
(:func:`default_transport`), and the timings both drivers (fixed and elastic) keep with their agents."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hora.launcher import procs
from hora.launcher.config import RunConfig
from hora.launcher.failures import RankState
from hora.launcher.remote.transport import SshTransport, Transport, transport_for
from hora.protocol import messages as protocol

PING_INTERVAL = 2.0  # seconds between the driver's pings to each agent
KILL_AFTER_GRACE = 10.0  # after grace + this, agents that still have not finished are killed


@dataclass
class AgentHandle:
    """One running agent (a local process or an ssh client) and its pipes."""

    index: int
    host: str
    proc: Any  # subprocess.Popen[bytes]
    ranks: list[int]
    started: bool = False
    finished: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            try:
                self.proc.stdin.write(protocol.encode(message))
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the agent is gone; its EOF event says so

    def close_stdin(self) -> None:
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def default_transport(cfg: RunConfig) -> Callable[[str, bool], Transport]:
    """Local hosts get :class:`LocalTransport`, the others :class:`SshTransport` with the job's ssh flags."""
    ssh = SshTransport(port=cfg.ssh_port, identity_file=cfg.ssh_identity_file, options=cfg.ssh_options,
                       config_file=cfg.ssh_config_file,
                       connect_timeout=max(1, int(min(cfg.start_timeout, 30))),
                       alive_interval=max(1, min(5, int(cfg.heartbeat_timeout // 3))))
    return transport_for(ssh)




def split_returncode(returncode: int | None) -> tuple[int | None, int | None]:
    """Popen's returncode -> (exit code, signal)."""
    if returncode is not None and returncode < 0:
        return None, -returncode
    return returncode, None


def start_pumps(agent: AgentHandle, events: queue.SimpleQueue[tuple[str, int, Any]]) -> None:
    """Two daemon threads turn the agent's output into driver events: ``msg`` (a protocol message on stdout),
    ``eof`` (stdout closed; the agent's exit code) and ``agent_err`` (a line the agent wrote to stderr)."""

    def pump() -> None:
        for raw in agent.proc.stdout:
            message = protocol.decode(raw)
            if message is not None:
                events.put(("msg", agent.index, message))
        events.put(("eof", agent.index, agent.proc.wait()))

    def pump_stderr() -> None:
        for raw in agent.proc.stderr:
            events.put(("agent_err", agent.index, raw.decode(errors="replace").rstrip("\n")))

    threading.Thread(target=pump, daemon=True).start()
    threading.Thread(target=pump_stderr, daemon=True).start()


def stop_agents(agents: Iterable[AgentHandle], grace: float) -> float:
    """Tell every agent to stop its workers (SIGTERM, SIGKILL after ``grace`` s); returns the deadline after
    which the driver calls :func:`force_kill` on the agents still running."""
    for agent in agents:
        agent.send({"t": protocol.STOP, "grace": grace})
    return time.monotonic() + grace + KILL_AFTER_GRACE


def force_kill(agents: Iterable[AgentHandle], states: Iterable[RankState] = ()) -> None:
    """Close every agent's stdin (they kill their workers) and kill agents that linger past 3 s; each of
    ``states`` that had not ended counts as stopped (exit code 1)."""
    for state in states:
        if not state.done:
            state.done, state.code, state.stopped = True, 1, True
    agents = list(agents)
    for agent in agents:
        agent.close_stdin()
    deadline = time.monotonic() + 3.0
    for agent in agents:
        try:
            agent.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs.signal_groups([agent.proc.pid], signal.SIGKILL)
