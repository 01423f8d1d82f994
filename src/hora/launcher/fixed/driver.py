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
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hora.diagnostics.merge import finish_job_timeline, rank_parts
from hora.errors import SetupError
from hora.launcher import envvars, output, procs
from hora.launcher.config import RunConfig
from hora.launcher.hosts import SlotInfo, assign_slots
from hora.launcher.output_lock import full
from hora.launcher.remote import preflight
from hora.launcher.remote.transport import Transport
from hora.launcher.supervision import root_cause
from hora.launcher.supervision.loop import Handle, JobLoop, record_exit
from hora.launcher.supervision.root_cause import RankState, RootCause
from hora.launcher.supervision.stall_watch import StallWatch
from hora.protocol import messages as protocol
from hora.protocol import network

log = logging.getLogger(__name__)


class Driver(JobLoop):
    """Runs a job: see the module docstring. The loop, Ctrl-C and the end are :class:`JobLoop`'s; these are
    the steps of a job whose ranks are placed once. A cluster framework's fixed job (``hora.ray``,
    ``hora.spark``) is this driver with its own :meth:`set_up`, :meth:`start` and :meth:`where`.

    Args:
        cfg: the checked job.
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the job's store (a :class:`~hora.protocol.signedstore.SignedStore`) before any worker
            starts (``hora.run`` puts the function there).
        slots: where each rank runs, when a cluster framework placed them (default: ``cfg.hosts``' slots).
    """

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None,
                 store_ready: Callable[[Any], None] | None = None, slots: Sequence[SlotInfo] | None = None) -> None:
        super().__init__(cfg, transport_for=transport_for, store_ready=store_ready)
        self.slots = list(slots) if slots is not None else assign_slots(cfg.hosts, cfg.np)
        self.ranks: dict[int, RankState] = {s.rank: RankState(s) for s in self.slots}
        self.used = {s.hostname for s in self.slots}  # -np may leave the last hosts without ranks: not touched
        self.first_failure: RankState | None = None
        self.root = RootCause()
        self.summary = ""  # the root cause in one line, repeated as the launcher's last words
        self.stalls = StallWatch(None, self.job_id, {})
        self.start_deadline = float("inf")  # every handle has started by then

    # --- the steps of a hora run job (a cluster framework's driver defines its own) ---------------------
    def set_up(self) -> None:
        self._open_logs()
        answers = {} if self.cfg.all_local else preflight.check_hosts(self.cfg, self.transport_for, self.used)
        preflight.refuse_same_machine(self.cfg.hosts, self.used, answers)
        remote = [h.name for h in self.cfg.hosts if not h.is_local and h.name in self.used]
        self.start_store(network.store_address(remote, self.cfg.network_interfaces))
        self.stalls = StallWatch(self.store, self.job_id, {r: s.slot.hostname for r, s in self.ranks.items()})

    def start(self) -> None:
        for index, host in enumerate(self.cfg.hosts):
            mine = [s for s in self.slots if s.host_index == index]
            if not mine:
                continue  # -np capped the job before this host
            workers = [{"rank": s.rank, "env": envvars.rank_env(s, store_addr=self.addr, store_port=self.port,
                                                                job_id=self.job_id)} for s in mine]
            self.start_agent(host.name, host.is_local, [s.rank for s in mine], self.agent_spec(host.name, workers))
        self.start_deadline = time.monotonic() + self.cfg.start_timeout

    def where(self, rank: int) -> str:
        """Where ``rank`` runs, as the driver's lines say it."""
        return f"host {self.ranks[rank].slot.hostname}"

    def start_timed_out(self) -> None:
        """Not every handle started its processes within --start-timeout: the job fails, naming the late hosts."""
        late = [h.host for h in self.handles if not (h.started or h.finished)]
        output.note(f"hosts {', '.join(late)} did not start their workers within --start-timeout "
                    f"{self.cfg.start_timeout:g}s; stopping")
        if self.first_failure is None:
            self.first_failure = RankState(self.ranks[self.handles[0].ranks[0]].slot, True, 1)
            self.summary = f"hosts {', '.join(late)} did not start within --start-timeout"
        self.stop_all()

    def wrap_up(self) -> None:
        merge_timeline(self.cfg.timeline_filename, self.cfg.np, self.job_id)

    # --- the loop's steps ------------------------------------------------------------------------------
    def over(self) -> bool:
        return all(r.done for r in self.ranks.values())

    def wait_s(self) -> float:
        return 0.1 if self.root.deadline else 0.5

    def look(self, now: float) -> None:
        if self.root.due(all(r.done for r in self.ranks.values()), self._follow_ons()):
            self._report_root()
        if self.root.deadline is None:  # no report is coming: a traceback held back too long is shown
            self.console.release_stale([r for r, s in self.ranks.items() if s.done])
        if not self.stopping:
            self._watch_stalls()
        if now > self.start_deadline and not all(h.started or h.finished for h in self.handles):
            self.start_timed_out()
            self.start_deadline = float("inf")

    def after_loop(self) -> None:
        if self.root.due(all_done=True):
            self._report_root()

    def processes(self) -> Iterable[RankState]:
        return self.ranks.values()

    def killed_label(self, state: RankState) -> str:
        return f"rank {state.slot.rank} on {self.where(state.slot.rank)}"

    def failed_status(self) -> int | None:
        if self.first_failure is None:
            return None
        state = self.first_failure
        output.note(f"job failed: {self.summary or state.describe()}")
        return procs.exit_status(state.code, state.sig)

    def on_message(self, handle: Handle, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == protocol.EXIT:
            state = self.ranks[int(message["r"])]
            record_exit(state, message)
            log.info("rank %d exited: %s", state.slot.rank, procs.describe_exit(state.code, state.sig))
            self.stalls.rank_ended(state.slot.rank, procs.describe_exit(state.code, state.sig))
            self.console.rank_done(state.slot.rank, failed=state.failed)
            if state.failed:
                self._on_failure(state)
        elif kind == protocol.PROBE and not self.stopping:
            output.note(self.stalls.on_probe(int(message["r"]), str(message.get("how", ""))))

    def on_handle_gone(self, handle: Handle, code: int) -> None:
        lost = [self.ranks[r] for r in handle.ranks if not self.ranks[r].done]
        if not lost:
            return
        how = handle.lost(code, f"rank{'s' if len(lost) > 1 else ''} {', '.join(str(r.slot.rank) for r in lost)}")
        for state in lost:
            state.done, state.code, state.exit_ts = True, 1, time.time()  # when the loss was seen
            state.stopped = self.stopping
        if not self.stopping:
            # other hosts cut off by the same fault are seen within one ssh keep-alive interval: wait for them
            self._on_failure(lost[0], how)
            self.root.extend(min(5.0, self.cfg.heartbeat_timeout / 3) + 1.0 if handle.remote else 0.0)

    # --- failures ---------------------------------------------------------------------------------------
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
        for handle in self.handles:
            mine = [r for r in probe if r in handle.ranks and not self.ranks[r].done]
            if mine:
                handle.send({"t": protocol.PROBE, "r": mine})
        found = self.stalls.shutdown_due()
        if found is not None and found.rank in self.ranks:
            # a transfer is stuck past the stall shutdown time: its ranks wait inside the communication backend
            # and cannot end themselves, so the job ends here, blaming the rank that froze in it
            self._on_failure(RankState(self.ranks[found.rank].slot, done=True, code=1), found.how)

    def _on_failure(self, state: RankState, how: str | None = None) -> None:
        if self.first_failure is not None or self.interrupted is not None:
            return
        state.how = how or state.how
        self.root.offer(state)  # decided after a short settle window: see root_cause.py

    def _follow_ons(self) -> set[int]:
        return root_cause.follow_ons(self.console.tails, {r: s.raised for r, s in self.ranks.items() if s.raised})

    def _waited_for(self) -> tuple[int, str] | None:
        """The rank the waiting ranks blamed on the board (posts still settling: a partition is named now)."""
        for line in self.stalls.poll(now_or_never=True)[1]:
            output.note(line)
        found = self.stalls.culprit()
        return (found.rank, found.how) if found is not None else None

    def _report_root(self) -> None:
        verdict = root_cause.decide(self.root, self.console, self.ranks, self.where, self._waited_for)
        self.first_failure, self.summary = verdict.state, verdict.summary
        root_cause.report(verdict, self.console, self.ranks, self.where)
        self.stop_all()


def merge_timeline(filename: str | None, size: int, job: str) -> None:
    """After a job: merge job ``job``'s rank files of ``--timeline-filename`` into the one file the user named; a
    failed merge is one note, never the job's status. A merge that found no events leaves an existing
    ``filename`` as it was (another job's timeline)."""
    if not filename:
        return
    path = os.path.abspath(filename)
    left = "left as it was" if os.path.exists(filename) else "not written"
    if not rank_parts(filename, job):  # each rank said why (a full disk, no init()): one line here, no merge
        output.note(f"no rank wrote a timeline file (did the ranks call hvd.init()? a rank that could not write "
                    f"its file said why): {path} {left}")
        return
    try:
        merged = finish_job_timeline(filename, size, job=job, remove_parts=True)
    except Exception as exc:  # noqa: BLE001 - a broken merge must not change the job's exit status
        output.note(f"could not merge the timeline files into {path}: {exc}; the ranks' files are kept: merge them "
                    f"later with python -m hora.diagnostics merge-timeline {filename} --job {job}")
        return
    if not merged:
        left = "left as it was" if os.path.exists(filename) else "not written"
        output.note(f"no rank wrote timeline events (did the ranks call hvd.init()?): {path} {left}")
        return
    output.note(f"timeline written to {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
