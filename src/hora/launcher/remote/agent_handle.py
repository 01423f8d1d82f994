"""The driver's side of an agent: its process and pipes (:class:`AgentHandle`, one of the handles the run loop of
:mod:`hora.launcher.supervision.loop` supervises) and how it is reached (:func:`default_transport`)."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hora.launcher import procs
from hora.launcher.config import RunConfig
from hora.launcher.remote.transport import SSH_FAILED, SshTransport, Transport, transport_for
from hora.protocol import messages as protocol


@dataclass
class AgentHandle:
    """One running agent (a local process or an ssh client) and its pipes.

    Args:
        index: its place in the driver's list of handles (the events it causes carry it).
        host: the host it runs on; ``remote``: reached over ssh.
        proc: the agent's process (a ``subprocess.Popen`` with binary pipes).
        ranks: the numbers of the processes it started.
    """

    index: int
    host: str
    proc: Any  # subprocess.Popen[bytes]
    ranks: list[int]
    remote: bool = False
    started: bool = False
    finished: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self, events: queue.SimpleQueue[tuple[str, int, Any]]) -> None:
        """Two daemon threads turn the agent's output into driver events: ``msg`` (a protocol message on stdout),
        ``eof`` (stdout closed; the agent's exit code) and ``agent_err`` (a line the agent wrote to stderr)."""

        def pump() -> None:
            for raw in self.proc.stdout:
                message = protocol.decode(raw)
                if message is not None:
                    events.put(("msg", self.index, message))
            events.put(("eof", self.index, self.proc.wait()))

        def pump_stderr() -> None:
            for raw in self.proc.stderr:
                events.put(("agent_err", self.index, raw.decode(errors="replace").rstrip("\n")))

        threading.Thread(target=pump, daemon=True).start()
        threading.Thread(target=pump_stderr, daemon=True).start()

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            try:
                self.proc.stdin.write(protocol.encode(message))
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # the agent is gone; its EOF event says so

    def close(self) -> None:
        """No more orders: closing its stdin makes the agent stop its workers and exit."""
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def running(self) -> bool:
        return bool(self.proc.poll() is None)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the agent to exit; True if it did."""
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the agent's process group and reap it."""
        procs.signal_groups([self.proc.pid], signal.SIGKILL)
        self.proc.wait()

    def lost(self, code: int, who: str) -> str:
        """How the processes ``who`` (``"ranks 0, 1"``) ended when the agent's output ended with ``code`` first."""
        if self.remote and code == SSH_FAILED:  # ssh's own code: the connection (or the host) went away
            return (f"lost: host {self.host} stopped answering: its ssh connection ended before {who} exited (the "
                    "host went down, its network link broke, or its hora agent was killed)")
        return f"lost: the agent on host {self.host} ended ({procs.describe_exit(*split_returncode(code))}) " \
               f"before {who} exited"


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
