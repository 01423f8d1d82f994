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
import time
from collections.abc import Callable, Iterable
from typing import Any

from hora.errors import SetupError
from hora.launcher import envvars, output, procs, store, timeline_hook
from hora.launcher.config import RunConfig
from hora.launcher.failures import RankState, RootCause
from hora.launcher.hosts import assign_slots
from hora.launcher.job_loop import JobLoop, record_exit
from hora.launcher.output_lock import full
from hora.launcher.remote import preflight
from hora.launcher.remote.agent_handle import AgentHandle, split_returncode
from hora.launcher.remote.transport import SSH_FAILED, Transport
from hora.launcher.stall_watch import StallWatch
from hora.protocol import messages as protocol
from hora.protocol import network
from hora.protocol.signedstore import SignedStore

log = logging.getLogger(__name__)


class Driver(JobLoop):
    """Runs a job: see the module docstring. The loop, Ctrl-C and the end are :class:`JobLoop`'s; these are
    the steps of a job whose ranks are placed once.

    Args:
        cfg: the checked job.
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the job's store (a :class:`~hora.protocol.signedstore.SignedStore`) before any worker
            starts (``hora.run`` puts the function there).
    """

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None,
                 store_ready: Callable[[Any], None] | None = None) -> None:
        super().__init__(cfg, transport_for=transport_for, store_ready=store_ready)
        self.slots = assign_slots(cfg.hosts, cfg.np)
        self.ranks: dict[int, RankState] = {s.rank: RankState(s) for s in self.slots}
        self.used = {s.hostname for s in self.slots}  # -np may leave the last hosts without ranks: not touched
        self.first_failure: RankState | None = None
        self.root = RootCause()
        self.summary = ""  # the root cause in one line, repeated as the launcher's last words
        self.stalls = StallWatch(None, self.job_id, {})
        self._start_deadline = float("inf")

    # --- set-up ----------------------------------------------------------------------------------------
    def _start_store(self, used: set[str]) -> tuple[str, int]:
        remote = [h.name for h in self.cfg.hosts if not h.is_local and h.name in used]
        addr = network.store_address(remote, self.cfg.network_interfaces)
        raw = store.listen(addr, max(self.cfg.start_timeout, 60))  # on addr only
        port = int(raw.port)
        self.addr, self.port = addr, port
        self.store = SignedStore(raw, self.secret, self.job_id, f"{addr}:{port}")
        self.stalls = StallWatch(self.store, self.job_id, {r: s.slot.hostname for r, s in self.ranks.items()})
        if self.store_ready is not None:
            self.store_ready(self.store)
        log.info("rendezvous store on %s:%d (job %s)", addr, port, self.job_id)
        return addr, port

    def _start_agents(self) -> None:
        for index, host in enumerate(self.cfg.hosts):
            mine = [s for s in self.slots if s.host_index == index]
            if not mine:
                continue  # -np capped the job before this host
            workers = [{"rank": s.rank, "env": envvars.rank_env(s, store_addr=self.addr, store_port=self.port,
                                                                job_id=self.job_id)} for s in mine]
            self.start_agent(index, host.name, host.is_local, [s.rank for s in mine],
                             self.agent_spec(host.name, workers))

    # --- running ---------------------------------------------------------------------------------------
    # --- the loop's steps ----------------------------------------------------------------------------------
    def set_up(self) -> None:
        self._open_logs()
        answers = {} if self.cfg.all_local else preflight.check_hosts(self.cfg, self.transport_for, self.used)
        preflight.refuse_same_machine(self.cfg.hosts, self.used, answers)
        self._start_store(self.used)

    def start(self) -> None:
        self._start_agents()
        self._start_deadline = time.monotonic() + self.cfg.start_timeout

    def over(self) -> bool:
        return all(r.done for r in self.ranks.values())

    def wait_s(self) -> float:
        return 0.1 if self.root.deadline else 0.5

    def look(self, now: float) -> None:
        if self.root.due(all(r.done for r in self.ranks.values())):
            self._report_root()
        if self.root.deadline is None:  # no report is coming: a traceback held back too long is shown
            self.console.release_stale([r for r, s in self.ranks.items() if s.done])
        if self._stop_deadline is None:
            self._watch_stalls()
        if now > self._start_deadline and not all(a.started or a.finished for a in self.agents):
            self._start_timed_out()
            self._start_deadline = float("inf")

    def after_loop(self) -> None:
        if self.root.due(all_done=True):
            self._report_root()

    def wrap_up(self) -> None:
        timeline_hook.merge(self.cfg.timeline_filename, self.cfg.np, self.job_id)

    def processes(self) -> Iterable[RankState]:
        return self.ranks.values()

    def killed_label(self, state: RankState) -> str:
        return f"rank {state.slot.rank} on host {state.slot.hostname}"

    def failed_status(self) -> int | None:
        if self.first_failure is None:
            return None
        state = self.first_failure
        output.note(f"job failed: {self.summary or procs.describe_exit(state.code, state.sig)}")
        return procs.exit_status(state.code, state.sig)

    def _open_logs(self) -> None:
        try:
            self.console.open_logs(range(self.cfg.np))
        except OSError as exc:  # e.g. a read-only filesystem, or the directory went away after the checks
            if full(exc):  # the job runs: one warning naming the file, as for a disk that fills up later
                self.console.open_logs(range(self.cfg.np), strict=False)
                return
            self.console.close()
            raise SetupError(f"--output-filename {self.cfg.output_filename}: cannot write the logs there "
                              f"({exc.strerror or exc}: {exc.filename or self.cfg.output_filename}); give a writable "
                              "directory") from None

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

    def on_message(self, agent: AgentHandle, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == protocol.EXIT:
            state = self.ranks[int(message["r"])]
            record_exit(state, message)
            log.info("rank %d exited: %s", state.slot.rank, procs.describe_exit(state.code, state.sig))
            self.stalls.rank_ended(state.slot.rank, procs.describe_exit(state.code, state.sig))
            self.console.rank_done(state.slot.rank, failed=state.failed)
            if state.failed:
                self._on_failure(state)
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
        others = sum(1 for r in self.ranks.values() if not r.done and r.slot.rank != rank)  # not the culprit
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

    def on_agent_gone(self, agent: AgentHandle, code: int) -> None:
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
