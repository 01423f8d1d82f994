"""The driver: runs one ``hora run`` job from preflight to exit code.

It makes the job's secret, hosts the rendezvous ``TCPStore`` (it outlives every worker; every value hora
puts there is authenticated with the secret, :mod:`hora.protocol.signedstore`), starts one agent per host through a
:class:`~hora.launcher.remote.transport.Transport`, prints the workers' output, and on the first failure prints the
root cause (rank, host, exit code or signal, the rank's traceback or last stderr lines), stops everyone
(SIGTERM, grace, SIGKILL) and returns that rank's exit status. Ctrl-C stops everything (a second one
kills at once) and says so: "stopping N rank(s)", then "stopped ...; exit code 130".

Example:
    >>> cfg = RunConfig(command=("python", "train.py"), np=2, hosts=parse_hosts("localhost:2"))
    >>> Driver(cfg).run()  # doctest: +SKIP
    0
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from hora.common import env as hora_env
from hora.errors import SetupError
from hora.launcher import envvars, output, procs, store, timeline_hook
from hora.launcher.config import RunConfig
from hora.launcher.failures import RankState, RootCause
from hora.launcher.hosts import SlotInfo, assign_slots
from hora.launcher.output_lock import OutputLock, lock_paths
from hora.launcher.remote import preflight
from hora.launcher.remote.agent_handle import (
    PING_INTERVAL,
    AgentHandle,
    default_transport,
    force_kill,
    split_returncode,
    start_pumps,
    stop_agents,
)
from hora.launcher.remote.transport import SSH_FAILED, Transport, agent_argv
from hora.launcher.stall_watch import StallWatch
from hora.protocol import messages as protocol
from hora.protocol import network
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore

log = logging.getLogger(__name__)

PROGRESS_LIVE, PROGRESS_PLAIN = 0.25, 1.0  # seconds between a progress bar's forwarded states


class Driver:
    """Runs a job: see the module docstring.

    Args:
        cfg: the checked job.
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the job's store (a :class:`~hora.protocol.signedstore.SignedStore`) before any worker
            starts (``hora.run`` puts the function there).
    """

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None,
                 store_ready: Callable[[Any], None] | None = None) -> None:
        self.cfg = cfg
        self.transport_for = transport_for or default_transport(cfg)
        self.store_ready = store_ready
        self.store: Any = None  # the job's SignedStore once it listens
        self.job_id = uuid.uuid4().hex[:12]
        self.secret = JobSecret.generate()  # to the agents on stdin, to the ranks in their own environment only
        self.events: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self.ranks: dict[int, RankState] = {}
        self.agents: list[AgentHandle] = []
        self.console = output.Console(prefix_timestamp=cfg.prefix_timestamp, output_dir=cfg.output_filename)
        self.first_failure: RankState | None = None
        self.root = RootCause()
        self.summary = ""  # the root cause in one line, repeated as the launcher's last words
        self.interrupted: int | None = None
        self._signals = 0  # interrupts received; read while shutting down, when no event loop runs
        self._stop_deadline: float | None = None
        self.stalls = StallWatch(None, self.job_id, {})

    # --- set-up ----------------------------------------------------------------------------------------
    def _start_store(self, used: set[str]) -> tuple[str, int]:
        remote = [h.name for h in self.cfg.hosts if not h.is_local and h.name in used]
        addr = network.store_address(remote, self.cfg.network_interfaces)
        raw = store.listen(addr, max(self.cfg.start_timeout, 60))  # on addr only
        port = int(raw.port)
        self.store = SignedStore(raw, self.secret, self.job_id, f"{addr}:{port}")
        self.stalls = StallWatch(self.store, self.job_id, {r: s.slot.hostname for r, s in self.ranks.items()})
        if self.store_ready is not None:
            self.store_ready(self.store)
        log.info("rendezvous store on %s:%d (job %s)", addr, port, self.job_id)
        return addr, port

    def _spec(self, host_index: int, slots: list[SlotInfo], addr: str, port: int) -> dict[str, Any]:
        base = envvars.forwarded(self._environ(), self.cfg.env)
        if self.cfg.network_interfaces:
            base.setdefault("GLOO_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
            base.setdefault("NCCL_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
        workers = [{"rank": s.rank, "env": envvars.rank_env(s, store_addr=addr, store_port=port,
                                                            job_id=self.job_id)} for s in slots]
        return {"t": "spec", "command": list(self.cfg.command), "cwd": self.cfg.cwd, "env": base,
                "unset": list(envvars.RANK_VARIABLES), "workers": workers, "store_addr": addr,
                "secret": self.secret.hex(),
                "heartbeat_timeout": self.cfg.heartbeat_timeout, "host": self.cfg.hosts[host_index].name,
                # a live bar on a terminal is redrawn 4 times a second; plain lines come at most once a second
                "progress_interval": PROGRESS_LIVE if self.console.live else PROGRESS_PLAIN}

    @staticmethod
    def _environ() -> dict[str, str]:
        return hora_env.launcher_environ()

    def _start_agents(self, slots: list[SlotInfo], addr: str, port: int) -> None:
        for index, host in enumerate(self.cfg.hosts):
            mine = [s for s in slots if s.host_index == index]
            if not mine:
                continue  # -np capped the job before this host
            transport = self.transport_for(host.name, host.is_local)
            try:
                proc = transport.start(host.name, agent_argv(self.cfg.python), self.cfg.cwd)
            except OSError as exc:  # e.g. no ssh client installed
                raise SetupError(f"host {host.name}: cannot start its agent ({exc.strerror or exc}); "
                                  "install openssh-client or check the Python path") from None
            agent = AgentHandle(index, host.name, proc, [s.rank for s in mine])
            self.agents.append(agent)
            agent.send(self._spec(index, mine, addr, port))
            start_pumps(agent, self.events)

    # --- running ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; return the exit status for the ``hora run`` process."""
        slots = assign_slots(self.cfg.hosts, self.cfg.np)
        self.ranks = {s.rank: RankState(s) for s in slots}
        used = {s.hostname for s in slots}  # -np may leave the last hosts without ranks: they are not touched
        outputs = OutputLock.hold(lock_paths(self.cfg.output_filename, self.cfg.timeline_filename), self.job_id)
        previous = {}
        try:
            self._open_logs()
            answers = {} if self.cfg.all_local else preflight.check_hosts(self.cfg, self.transport_for, used)
            preflight.refuse_same_machine(self.cfg.hosts, used, answers)
            addr, port = self._start_store(used)
            if threading.current_thread() is threading.main_thread():  # signal handlers live there only
                previous = {s: signal.signal(s, self._on_signal) for s in procs.stop_signals()}
            try:
                self._start_agents(slots, addr, port)
                self._loop()
                if self.root.due(all_done=True):
                    self._report_root()
            finally:
                self._shutdown_agents()  # Ctrl-C still reaches _on_signal here: it kills, never aborts
                self.console.close()
            timeline_hook.merge(self.cfg.timeline_filename, self.cfg.np, self.job_id)
            return self._exit_status()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            outputs.release()

    def _open_logs(self) -> None:
        try:
            self.console.open_logs(range(self.cfg.np))
        except OSError as exc:  # e.g. a read-only filesystem, or the directory went away after the checks
            self.console.close()
            raise SetupError(f"--output-filename {self.cfg.output_filename}: cannot write the logs there "
                              f"({exc.strerror or exc}: {exc.filename or self.cfg.output_filename}); give a writable "
                              "directory") from None

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.events.put(("signal", -1, signum))

    def _loop(self) -> None:
        last_ping = time.monotonic()
        start_deadline = time.monotonic() + self.cfg.start_timeout
        while not all(r.done for r in self.ranks.values()):
            try:
                kind, index, value = self.events.get(timeout=0.1 if self.root.deadline else 0.5)
                self._handle(kind, index, value)
            except queue.Empty:
                self.console.flush()
            if self.root.due(all(r.done for r in self.ranks.values())):
                self._report_root()
            if self.root.deadline is None:  # no report is coming: a traceback held back too long is shown
                self.console.release_stale([r for r, s in self.ranks.items() if s.done])
            now = time.monotonic()
            if self._stop_deadline is None:
                self._watch_stalls()
            if now - last_ping >= PING_INTERVAL:
                last_ping = now
                for agent in self.agents:
                    agent.send({"t": protocol.PING})
            if now > start_deadline and not all(a.started or a.finished for a in self.agents):
                self._start_timed_out()
                start_deadline = float("inf")
            if self._stop_deadline is not None and now > self._stop_deadline:
                self._force_kill()

    def _watch_stalls(self) -> None:
        """Ranks that wait for silent peers: ask those peers' agents about them; print what was found."""
        probe, notes = self.stalls.poll()
        for note in notes:
            output.note(note)
        for agent in self.agents:
            mine = [r for r in probe if r in agent.ranks and not self.ranks[r].done]
            if mine:
                agent.send({"t": protocol.PROBE, "r": mine})
        found = self.stalls.shutdown_due()
        if found is not None and found.rank in self.ranks:
            # a transfer is stuck past the stall shutdown time: its ranks wait inside the communication backend
            # and cannot end themselves, so the job ends here, blaming the rank that froze in it
            self._on_failure(RankState(self.ranks[found.rank].slot, done=True, code=1), found.how)

    def _handle(self, kind: str, index: int, value: Any) -> None:
        if kind == "msg":
            self._on_message(self.agents[index], value)
        elif kind == "eof":
            self._on_agent_gone(self.agents[index], value)
        elif kind == "agent_err":
            output.note(f"host {self.agents[index].host}: {value}")
        elif kind == "signal":
            self._on_interrupt(value)

    def _on_message(self, agent: AgentHandle, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == protocol.OUT:
            self.console.worker_line(int(message["r"]), message["s"], message["l"], message.get("ts"),
                                     message.get("k", protocol.LINE))
        elif kind == protocol.EXIT:
            state = self.ranks[int(message["r"])]
            state.done, state.code, state.sig = True, message.get("code"), message.get("sig")
            state.stopped = bool(message.get("stopped"))
            state.killed = float(message.get("killed") or 0.0)
            if message.get("oom"):  # the agent found the kernel's OOM killer behind the SIGKILL
                state.how = f"{message['oom']}, {procs.describe_exit(state.code, state.sig)}"
            state.exit_ts = float(message.get("ts") or time.time())
            log.info("rank %d exited: %s", state.slot.rank, procs.describe_exit(state.code, state.sig))
            self.stalls.rank_ended(state.slot.rank, procs.describe_exit(state.code, state.sig))
            self.console.rank_done(state.slot.rank, failed=state.failed)
            if state.failed:
                self._on_failure(state)
        elif kind == protocol.STARTED:
            agent.started = True
            log.info("host %s (%s) started ranks %s", agent.host, message.get("hostname"), agent.ranks)
        elif kind == protocol.DONE:
            agent.finished = True
        elif kind == protocol.PROBE and self._stop_deadline is None:
            output.note(self.stalls.on_probe(int(message["r"]), str(message.get("how", ""))))

    def _on_failure(self, state: RankState, how: str | None = None) -> None:
        if self.first_failure is not None or self.interrupted is not None:
            return
        state.how = how or state.how
        self.root.offer(state)  # decided after a short settle window: see failures.py

    def _report_root(self) -> None:
        follow_ons = {r for r, tail in self.console.tails.items() if output.follow_on(list(tail))}
        state = self.first_failure = self.root.choose(self.console.traceback_ts, follow_ons)
        rank, host = state.slot.rank, state.slot.hostname
        how = state.how or procs.describe_exit(state.code, state.sig)
        self.summary = f"rank {rank} on host {host}: {how}"
        culprit = self.root.culprit(self.console.traceback_ts, follow_ons)
        found = None
        if not (state.sig or state.how):
            for line in self.stalls.poll(now_or_never=True)[1]:  # posts still settling: a partition is named now
                output.note(line)
            found = self.stalls.culprit()
        lost = [c for c in self.root.candidates if c.how and c.how.startswith("lost")]
        if found is not None and found.rank in self.ranks:
            # a waiting rank failed (a stall shutdown, an init() timeout, a peer that exited): blame the rank
            # it waited for, as the waiting rank itself named it (or the partition the driver found)
            raised = output.exception_name(output.traceback_of(list(self.console.tails[rank])))
            by = "it" if found.rank == rank else f"rank {rank} on host {host} waited for it and"
            how = f"{found.how} ({by} {raised})"
            rank, host = found.rank, self.ranks[found.rank].slot.hostname
            self.summary = f"rank {rank} on host {host}: {found.how}"
        elif len({c.slot.hostname for c in lost}) > 1:  # several hosts went at once: name them all
            names = sorted({c.slot.hostname for c in lost})
            hosts = f"hosts {', '.join(names[:-1])} and {names[-1]}"
            ranks = sorted(r.slot.rank for r in self.ranks.values() if r.slot.hostname in names)
            how = (f"lost: {hosts} stopped answering: their ssh connections ended before ranks "
                   f"{', '.join(map(str, ranks))} exited (the hosts went down, their network links broke, or their "
                   "hora agents were killed)")
            self.summary = f"{hosts} lost"
        elif culprit is not None:  # it raised first, its peers failed before it finished exiting
            how = f"raised an exception (traceback below); then rank {rank} on host {host} ended with {how}"
            rank, host = culprit, self.ranks[culprit].slot.hostname
            self.summary = f"rank {rank} on host {host} {how}"
        others = sum(1 for r in self.ranks.values() if not r.done)
        self.console.flush()
        finished = [r.slot.rank for r in self.ranks.values() if r.done and r.code == 0 and not r.sig]
        # the report shows the root cause's traceback once: ranks that raised the same error get one line in it,
        # ranks that raised another one show theirs first, as they printed it
        tb = output.traceback_of(list(self.console.tails[rank])) or []
        self.console.take_held(rank)
        same = [r for r in self.console.held_ranks() if output.same_error(self.console.held(r), tb)]
        followed = [r for r in self.console.held_ranks() if r not in same and output.follow_on(self.console.held(r))]
        for r in self.console.held_ranks():
            if r in same or r in followed:
                self.console.take_held(r)
            else:
                self.console.release(r)
        output.print_lines(output.failure_report(rank, host, how, list(self.console.tails[rank]), others, finished,
                                                 same, followed))
        self._stop_all()

    def _on_agent_gone(self, agent: AgentHandle, code: int) -> None:
        agent.finished = True
        lost = [self.ranks[r] for r in agent.ranks if not self.ranks[r].done]
        if not lost:
            return
        ranks = f"rank{'s' if len(lost) > 1 else ''} {', '.join(str(r.slot.rank) for r in lost)}"
        remote = not self.cfg.hosts[agent.index].is_local
        if remote and code == SSH_FAILED:  # ssh's own code: the connection (or the host) went away
            how = (f"lost: host {agent.host} stopped answering: its ssh connection ended before {ranks} exited "
                   "(the host went down, its network link broke, or its hora agent was killed)")
        else:
            ended = procs.describe_exit(*split_returncode(code))
            how = f"lost: the agent on host {agent.host} ended ({ended}) before {ranks} exited"
        for state in lost:
            state.done, state.code, state.exit_ts = True, 1, time.time()  # when the loss was seen
            state.stopped = self._stop_deadline is not None
        if self._stop_deadline is None:
            # other hosts cut off by the same fault are seen within one ssh keep-alive interval: wait for them
            self._on_failure(lost[0], how)
            self.root.extend(min(5.0, self.cfg.heartbeat_timeout / 3) + 1.0 if remote else 0.0)

    def _start_timed_out(self) -> None:
        late = [a.host for a in self.agents if not (a.started or a.finished)]
        output.note(f"hosts {', '.join(late)} did not start their workers within --start-timeout "
                    f"{self.cfg.start_timeout:g}s; stopping")
        if self.first_failure is None:
            self.first_failure = RankState(self.ranks[self.agents[0].ranks[0]].slot, True, 1)
            self.summary = f"hosts {', '.join(late)} did not start within --start-timeout"
        self._stop_all()

    def _on_interrupt(self, signum: int) -> None:
        running = sum(1 for r in self.ranks.values() if not r.done)
        if self.interrupted is not None or self._stop_deadline is not None:
            if self.interrupted is None:
                self.interrupted = signum
            output.note(f"interrupted again: killing the {running} rank(s) still running now (SIGKILL)"
                        if running else "interrupted again: every rank has already exited; finishing")
            self._force_kill()
            return
        self.interrupted = signum
        again = "; press Ctrl-C again to kill them now" if signum == signal.SIGINT else ""
        output.note(f"interrupted ({procs.stop_reason(signum)}): stopping {running} rank(s) "
                    f"(SIGTERM, SIGKILL after {self.cfg.grace:g}s{again})")
        self._stop_all()

    def _stop_all(self) -> None:
        if self._stop_deadline is None:
            self._stop_deadline = stop_agents(self.agents, self.cfg.grace)

    def _force_kill(self) -> None:
        """Kill every agent (see :func:`force_kill`); ranks that had not ended count as stopped."""
        force_kill(self.agents, self.ranks.values())

    def _shutdown_agents(self) -> None:
        """Let every agent finish (closing its stdin stops its workers); an interrupt here kills at once."""
        for agent in self.agents:
            agent.close_stdin()
        signals = self._signals
        deadline = time.monotonic() + 5.0
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
        killed = [r for r in self.ranks.values() if r.killed]
        if killed:
            output.note(output.grace_ran_out([f"rank {r.slot.rank} on host {r.slot.hostname}" for r in killed],
                                             max(r.killed for r in killed)))
        if self.first_failure is not None:
            state = self.first_failure
            output.note(f"job failed: {self.summary or procs.describe_exit(state.code, state.sig)}")
            return procs.exit_status(state.code, state.sig)
        if self.interrupted is not None:
            status = 128 + self.interrupted
            output.note(f"stopped after {procs.signal_name(self.interrupted)}: no rank is running; "
                        f"exit code {status}")
            return status
        return 0
