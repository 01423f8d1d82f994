"""The per-host agent: spawns this host's workers, streams their output, reports their exits.

Started by the driver (locally, or over ssh) as ``python -m hora.launcher.remote.agent`` or through
:data:`hora.launcher.remote.transport.BOOTSTRAP`; it reads the job spec as one JSON line on stdin, then commands. The
spec carries the job's secret, which the agent puts in each worker's environment (``HORA_SECRET``) and nowhere
else: not in its own environment, not on a command line.
If stdin closes or goes silent past the heartbeat timeout (the driver or the link is gone), it kills its
workers' process groups and every process below it: no worker outlives its launcher. It is the subreaper
of its descendants, so a process a worker started in a new session (setsid, a daemon that double-forks) is
re-parented to it and ended with the job too. Workers also get ``PR_SET_PDEATHSIG`` so they die if the
agent itself is SIGKILLed.

Only the standard library and light hora modules (``env``, ``errors``, this package) are imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from hora.common import env as hora_env
from hora.launcher import procs
from hora.launcher.remote.oom import OomWatch
from hora.protocol import messages as protocol
from hora.protocol import network
from hora.protocol.jobsecret import ENV_SECRET

log = logging.getLogger(__name__)

EOF_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when the driver is gone
REAP_INTERVAL = 5.0  # seconds between looks (a /proc scan) for ended orphans to reap
SHIM_DIR = str(Path(__file__).resolve().parents[2] / "_compat")  # src/hora/_compat (this is launcher/remote/)


@dataclass
class Worker:
    """One worker process and the threads that read its output."""

    rank: int
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)
    stopped: bool = False  # the agent asked it to stop (its exit is not a failure)
    killed: float | None = None  # still running when this grace (seconds) after SIGTERM ran out: SIGKILLed
    splitters: dict[str, protocol.LineSplitter] = field(default_factory=dict)  # stdout, stderr
    lock: threading.Lock = field(default_factory=threading.Lock)  # orders the two streams' messages


class Agent:
    """Runs one host's share of the job. See the module docstring."""

    def __init__(self, spec: dict[str, Any], out: BinaryIO) -> None:
        self.spec = spec
        self._out = out
        self._out_lock = threading.Lock()
        # SimpleQueue: put() is reentrant, so the signal handler may call it while get() is waiting
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.workers: dict[int, Worker] = {}
        self._exited: set[int] = set()
        self._stopping = False
        self.oom = OomWatch()  # the workers' memory cgroups: was a SIGKILL the OOM killer's?

    # --- messages -------------------------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        data = protocol.encode(message)
        with self._out_lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.events.put(("eof", None))  # the driver is gone

    # --- starting -------------------------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        """This host's environment, overlaid with the launcher's forwarded variables."""
        env = hora_env.launcher_environ()
        for name in self.spec.get("unset", []):
            env.pop(name, None)
        env.update(self.spec.get("env", {}))
        store_addr = self.spec.get("store_addr", "")
        if "GLOO_SOCKET_IFNAME" not in env and store_addr:
            iface = network.interface_towards(store_addr)
            if iface:  # the interface that reaches the store: every worker on every host agrees
                env["GLOO_SOCKET_IFNAME"] = iface
                env.setdefault("NCCL_SOCKET_IFNAME", iface)
        if importlib.util.find_spec("horovod") is None:  # no real Horovod: horovod.torch -> hora
            path = env.get("PYTHONPATH", "")
            env["PYTHONPATH"] = f"{path}{os.pathsep}{SHIM_DIR}" if path else SHIM_DIR
        return env

    def start_workers(self) -> None:
        base = self.base_env()
        secret = self.spec.get("secret")  # the job's: in each worker's own environment, never on a command line
        command = list(self.spec["command"])
        pids: dict[str, int] = {}
        for item in self.spec["workers"]:
            rank = int(item["rank"])
            env = dict(base)
            env.update(item["env"])
            if secret:
                env[ENV_SECRET] = str(secret)
            try:
                proc = subprocess.Popen(
                    command, env=env, cwd=self._cwd(), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                    preexec_fn=procs.child_setup(os.getpid()),  # noqa: PLW1509 - only prctl, before threads matter
                )
            except OSError as exc:
                self._spawn_failed(rank, command, exc)
                continue
            self.oom.track(proc.pid)
            interval = float(self.spec.get("progress_interval", 1.0))
            worker = Worker(rank, proc, splitters={s: protocol.LineSplitter(interval) for s in ("stdout", "stderr")})
            self.workers[rank] = worker
            pids[str(rank)] = proc.pid
            for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                reader = threading.Thread(target=self._read, args=(worker, stream, pipe), daemon=True)
                reader.start()
                worker.readers.append(reader)
            threading.Thread(target=self._wait, args=(worker,), daemon=True).start()
        self.send({"t": protocol.STARTED, "hostname": socket.gethostname(), "pids": pids})

    def _cwd(self) -> str | None:
        """The launcher's working directory when this host has it (shared filesystem), else the agent's."""
        cwd = self.spec.get("cwd")
        return cwd if cwd and os.path.isdir(cwd) else None

    def _spawn_failed(self, rank: int, command: list[str], exc: OSError) -> None:
        reason = exc.strerror or str(exc)
        where = self._cwd() or os.getcwd()
        self.send({"t": protocol.OUT, "r": rank, "s": "stderr", "ts": time.time(),
                   "l": f"hora: cannot start {command[0]!r} in {where}: {reason}"})
        self._exited.add(rank)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        self.send({"t": protocol.EXIT, "r": rank, "code": code, "sig": None, "stopped": False})

    # --- watching -------------------------------------------------------------------------------------
    def _read(self, worker: Worker, stream: str, pipe: BinaryIO | None) -> None:
        """Forward one of a worker's streams: its lines, and its progress bars' states (thinned).

        A bar state held back by the thinning goes out once its interval has passed, and before the next
        line of the worker's other stream, so the console shows a bar's latest state before what follows.
        """
        assert pipe is not None
        splitter = worker.splitters[stream]
        other = worker.splitters["stderr" if stream == "stdout" else "stdout"]
        fd = pipe.fileno()
        while True:
            wait = splitter.interval if splitter.has_pending else None
            if wait is not None and not select.select([fd], [], [], wait)[0]:
                with worker.lock:
                    self._send_pieces(worker.rank, stream, splitter.due(time.time()))
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            now = time.time()
            with worker.lock:
                pieces = splitter.feed(chunk, now) if chunk else splitter.flush()
                if any(kind == protocol.LINE for kind, _ in pieces):
                    self._send_pieces(worker.rank, "stderr" if stream == "stdout" else "stdout",
                                      other.take_pending(now))
                self._send_pieces(worker.rank, stream, pieces)
            if not chunk:
                pipe.close()
                return

    def _send_pieces(self, rank: int, stream: str, pieces: list[tuple[str, str]]) -> None:
        for kind, text in pieces:
            message: dict[str, Any] = {"t": protocol.OUT, "r": rank, "s": stream, "ts": time.time(), "l": text}
            if kind != protocol.LINE:
                message["k"] = kind
            self.send(message)

    def _wait(self, worker: Worker) -> None:
        code = worker.proc.wait()
        ended = time.time()
        for reader in worker.readers:  # all its output goes out before its exit is reported
            reader.join(timeout=2.0)
        self.events.put(("exit", (worker, code, ended)))

    def _report_exit(self, worker: Worker, code: int, ended: float) -> None:
        self._exited.add(worker.rank)
        sig = -code if code < 0 else None
        message = {"t": protocol.EXIT, "r": worker.rank, "code": None if sig else code, "sig": sig,
                   "stopped": worker.stopped, "ts": ended}
        if worker.killed:  # a grace of 0 (stop at once) is no grace that ran out
            message["killed"] = worker.killed
        if sig == signal.SIGKILL and not worker.stopped:
            oom = self.oom.explain(worker.proc.pid)
            if oom is not None:
                message["oom"] = oom
        self.send(message)

    # --- stopping -------------------------------------------------------------------------------------
    def live(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.proc.poll() is None]

    def stop(self, grace: float) -> None:
        """SIGTERM every worker's process group and every process the workers started elsewhere (a new
        session), wake stopped ones (SIGCONT) so they see it, wait up to ``grace`` seconds, then SIGKILL."""
        self._stopping = True
        for worker in self.workers.values():
            worker.stopped = worker.stopped or worker.proc.poll() is None
        groups = [w.proc.pid for w in self.live()]
        procs.signal_groups(groups, signal.SIGTERM)
        procs.signal_pids(procs.descendants(os.getpid()), signal.SIGTERM)
        procs.signal_groups(groups, signal.SIGCONT)
        procs.signal_pids(procs.descendants(os.getpid()), signal.SIGCONT)
        deadline = time.monotonic() + grace
        while self.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        for worker in self.live():
            worker.killed = grace
        self.kill_all()

    def stop_some(self, grace: float, ranks: list[int]) -> None:
        """SIGTERM the process groups of the workers ``ranks`` (an elastic job lets them go), SIGKILL after
        ``grace`` seconds; the other workers go on."""
        chosen = [w for r, w in self.workers.items() if r in ranks and w.proc.poll() is None]
        for worker in chosen:
            worker.stopped = True
        groups = [w.proc.pid for w in chosen]
        procs.signal_groups(groups, signal.SIGTERM)
        procs.signal_groups(groups, signal.SIGCONT)

        def kill_left() -> None:
            late = [w for w in chosen if w.proc.poll() is None]
            for worker in late:
                worker.killed = grace
            procs.signal_groups([w.proc.pid for w in late], signal.SIGKILL)

        timer = threading.Timer(grace, kill_left)
        timer.daemon = True
        timer.start()

    def kill_all(self) -> None:
        """SIGKILL every worker's process group, then every process left below this agent: what a worker
        started in a new session (setsid, a daemon) is re-parented here (:func:`procs.become_subreaper`)."""
        procs.signal_groups([w.proc.pid for w in self.workers.values()], signal.SIGKILL)
        procs.signal_pids(procs.descendants(os.getpid()), signal.SIGKILL)

    def _reap_orphans(self) -> None:
        """Reap re-parented descendants that ended (never a worker: its Popen reaps it)."""
        workers = {w.proc.pid for w in self.workers.values()}
        for pid in procs.descendants(os.getpid()):
            if pid not in workers and procs.process_state(pid).get("state") == "Z":
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def probe(self, ranks: list[int]) -> None:
        """Tell the driver what /proc says about each rank's process (it does not answer its peers)."""
        for rank in ranks:
            worker = self.workers.get(rank)
            if worker is None:
                continue
            info = procs.process_state(worker.proc.pid) if worker.proc.poll() is None else {}
            self.send({"t": protocol.PROBE, "r": rank, "pid": worker.proc.pid, "info": info,
                       "how": procs.describe_state(info)})

    # --- main loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        """Watch workers and commands until every worker has exited; return the agent's exit code."""
        threading.Thread(target=self._read_commands, daemon=True).start()
        timeout = float(self.spec.get("heartbeat_timeout", 0) or 0)
        last_ping = last_reap = time.monotonic()
        while len(self._exited) < len(self.spec["workers"]):
            try:
                kind, value = self.events.get(timeout=0.5)
            except queue.Empty:
                kind, value = "tick", None
            if kind == "exit":
                self._report_exit(*value)
            elif kind == "probe":
                self.probe(value)
            elif kind == "ping":
                last_ping = time.monotonic()
            elif kind == "stop":
                self.stop(float(value))
            elif kind == "stop_some":
                self.stop_some(*value)
            elif kind == "eof" or (timeout and time.monotonic() - last_ping > timeout):
                log.warning("%s: stopping this host's workers", "the launcher is gone" if kind == "eof"
                            else f"no word from the launcher for {timeout:g}s")
                self.stop(EOF_GRACE)
                self._drain_exits()
                return 1
            if kind == "tick" and time.monotonic() - last_reap > REAP_INTERVAL:
                last_reap = time.monotonic()
                self._reap_orphans()
                for worker in self.live():  # a worker may have moved to a cgroup of its own
                    self.oom.track(worker.proc.pid)
        self.kill_all()
        self.send({"t": protocol.DONE})
        return 0

    def _drain_exits(self) -> None:
        deadline = time.monotonic() + 2.0
        while len(self._exited) < len(self.workers) and time.monotonic() < deadline:
            try:
                kind, value = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "exit":
                self._report_exit(*value)

    def _read_commands(self) -> None:
        for raw in sys.stdin.buffer:
            message = protocol.decode(raw)
            if message is None:
                continue
            if message["t"] == protocol.STOP and message.get("r") is not None:  # some workers only (elastic)
                self.events.put(("stop_some", (float(message.get("grace", 5.0)), [int(r) for r in message["r"]])))
            elif message["t"] == protocol.STOP:
                self.events.put(("stop", message.get("grace", 5.0)))
            elif message["t"] == protocol.PING:
                self.events.put(("ping", None))
            elif message["t"] == protocol.PROBE:
                self.events.put(("probe", [int(r) for r in message.get("r", [])]))
        self.events.put(("eof", None))


def _on_signal(agent: Agent, signum: int) -> None:
    if signum == signal.SIGINT:
        return  # Ctrl-C is the driver's to handle; it sends "stop"
    agent.events.put(("eof", None))


def main() -> int:
    """Entry point: read the spec from stdin, run the workers, exit when they are all done."""
    logging.basicConfig(level=logging.WARNING, format="hora agent: %(message)s", stream=sys.stderr)
    line = sys.stdin.buffer.readline()
    spec = protocol.decode(line) if line else None
    if spec is None or spec.get("t") != "spec":
        print("hora agent: expected a job spec as the first line of stdin", file=sys.stderr)
        return 2
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the channel
    procs.become_subreaper()  # what the workers start in a new session stays ours to stop
    agent = Agent(spec, out)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: _on_signal(agent, s))
    agent.start_workers()
    code = agent.run()
    # the command reader may sit in a read of stdin (an elastic job's driver keeps it open after this host's
    # workers left): end here rather than let interpreter shutdown trip over that thread's lock
    out.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
