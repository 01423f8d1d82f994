"""What the elastic driver knows, and how it ends a job: its workers, the newest world and its members, the
job's failure and the stopping of every agent (the base of :class:`hora.launcher.elastic.driver.ElasticDriver`,
with :mod:`hora.launcher.elastic.worlds` between them)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hora.launcher import output, procs
from hora.launcher.config import ElasticConfig, RunConfig
from hora.launcher.elastic.hosts import Absences, Discovery, HostManager
from hora.launcher.failures import RankState
from hora.launcher.remote.agent_handle import AgentHandle, default_transport, force_kill, stop_agents
from hora.launcher.remote.transport import Transport
from hora.launcher.stall_watch import StallWatch
from hora.protocol import elastic as ep
from hora.protocol import messages as protocol
from hora.protocol.jobsecret import JobSecret

log = logging.getLogger(__name__)


def note(message: str) -> None:
    """One line of the elastic driver's own (``hora run: elastic: ...``)."""
    output.note(f"elastic: {message}")


@dataclass
class Worker:
    """One worker process of the job (its id may be reused by a later process on the same slot)."""

    wid: str
    host: str
    number: int  # its name in the output and the agent messages, unique in the job
    agent: AgentHandle
    state: RankState  # its start values, and how it ended
    ready: int | None = None  # the last value seen in its ready key
    leaving: bool = False  # its host (or slot) is gone or blacklisted: no world will hold it again
    leave_by: float | None = None  # stop it at this time if it is still running
    announced: bool = False  # an update told the members it is ready to join
    stalled: str = ""  # why the stall inspector had it stopped (its exit is then a failure, not a stop)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return not self.state.done


# The exit status of a job the launcher ended at one of its limits (--reset-limit, --elastic-timeout), rather
# than the status of some worker the job may have survived long before: sysexits' EX_TEMPFAIL (the job may go on
# when retried, e.g. with more hosts).
LIMIT_EXIT = 75


@dataclass
class _Failure:
    """Why the job fails: the one line, and the worker whose report explains it (if any)."""

    summary: str
    worker: Worker | None = None
    code: int = 1


@dataclass
class _Stats:
    resets: int = 0
    started: int = 0
    failures: list[str] = field(default_factory=list)


class ElasticState:
    """The elastic driver's state and the queries and exits every part of it uses.

    Args:
        cfg: the checked job (``cfg.elastic`` set).
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the job's store (a :class:`~hora.protocol.signedstore.SignedStore`) before any worker
            starts.
    """

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None,
                 store_ready: Callable[[Any], None] | None = None) -> None:
        assert cfg.elastic is not None
        self.cfg = cfg
        self.store_ready = store_ready  # called with the store once it listens (hora.run ships its function)
        self.ecfg: ElasticConfig = cfg.elastic
        self.transport_for = transport_for or default_transport(cfg)
        self.job_id = ""
        self.secret = JobSecret.generate()  # to the agents on stdin, to the workers in their own environment only
        self.store: Any = None  # the job's SignedStore once it listens
        self.addr, self.port = "", 0
        self.events: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self.hostman = HostManager(self.ecfg.cooldown)
        self.agents: list[AgentHandle] = []
        self.workers: dict[int, Worker] = {}  # by number
        self.world: ep.World | None = None
        self.member_numbers: set[int] = set()  # the worker processes of the newest world
        self.updates = 0  # the value of the store's ``updates`` counter
        self._discovered = 0  # the value of the store's ``discovered`` counter
        self.stalls = StallWatch(None, "", {})  # the newest world's board (see _watch_stalls)
        self.console = output.Console(prefix_timestamp=cfg.prefix_timestamp, output_dir=cfg.output_filename)
        self.failure: _Failure | None = None
        self.finishing = False  # a member returned: no more worlds, the others finish too
        self.interrupted: int | None = None
        self.stats = _Stats()
        self._signals = 0
        self._stop_deadline: float | None = None
        self._reset_since: float | None = None
        self._lost_member = False  # a member of the newest world died or left: a reset is due
        self._handing_over = False  # the members left are on removed hosts and wait for newcomers (said once)
        self.discovery: Discovery | None = None  # the --host-discovery-script, when the job has one
        self.absences = Absences()  # hosts discovery left out, until their removal is confirmed
        self._unlisted_since: float | None = None  # discovery lists no host of the newest world's workers
        self._published_ts = 0.0  # wall-clock time the newest world was published
        self._short_since: float | None = None  # since when fewer than --min-np slots are available
        self._start_deadline = 0.0
        self._stopping = threading.Event()
        self._last: Worker | None = None  # the last worker that failed (the root cause of a job failure)

    # --- the newest world and its members --------------------------------------------------------------
    def _key(self, key: str, **fields: object) -> str:
        return ep.elastic_key(self.job_id, key, **fields)

    def _members(self) -> list[Worker]:
        """The live workers of the newest world that will be in the next one."""
        if self.world is None:
            return []
        return [w for w in self.workers.values() if w.alive and not w.leaving and self._member(w)]

    def _member(self, w: Worker) -> bool:
        """``w`` (this process, not an earlier one with its id) is in the newest world."""
        return w.number in self.member_numbers

    def _previous(self, keep: list[Worker]) -> ep.World | None:
        """The newest world reduced to the members in ``keep``: what new ranks are ordered by (a new process
        that reuses the id of a member that died is new, never the holder of the state)."""
        if self.world is None:
            return None
        ids = {w.wid for w in keep if self._member(w)}
        return ep.World(self.world.gen, {k: v for k, v in self.world.workers.items() if k in ids}, self.world.updates)

    def _newcomers(self) -> list[Worker]:
        """Live workers not in the newest world that posted ready and may join."""
        return [w for w in self.workers.values()
                if w.alive and not w.leaving and w.ready is not None and not self._member(w)]

    def _steady(self) -> bool:
        """Nothing is under way: every live worker is a member of the newest world and has not posted ready for
        the next one, no member was lost, no announced host change waits for its world, nobody is leaving."""
        world = self.world
        if world is None or self.finishing or self._lost_member or self._stop_deadline is not None:
            return False
        if self.updates > world.updates:
            return False
        return all(self._member(w) and not w.leaving and w.leave_by is None and w.ready != world.gen
                   for w in self.workers.values() if w.alive)

    def _member_at(self, rank: int) -> Worker | None:
        """The live worker with rank ``rank`` in the newest world."""
        if self.world is None:
            return None
        return next((w for w in self._members() if self.world.rank_of(w.wid) == rank), None)

    def _last_failed(self) -> Worker | None:
        return self._last

    # --- failing and stopping the job ------------------------------------------------------------------
    def _watch_stalls(self) -> None:
        """The newest world's board, as the fixed driver reads it (:mod:`hora.launcher.stall_watch`): the silent peers
        of waiting ranks are probed by their agents; a member that the stall shutdown time gave up on (frozen in
        a data transfer, or named by the ranks that stopped waiting for it and reset) is stopped as a failed
        worker: its host is blacklisted and the next world goes on without it."""
        if self.world is None:
            return
        probe, notes = self.stalls.poll()
        for line in notes:
            output.note(line)
        for rank in probe:
            w = self._member_at(rank)
            if w is not None:
                w.agent.send({"t": protocol.PROBE, "r": [w.number]})
        found = self.stalls.shutdown_due("hora run stopped it; the others go on without it")
        if found is None and any(w.ready == self.world.gen for w in self._members()):
            found = self.stalls.culprit()  # the others reset after their stall shutdown: is it the late one?
            w = self._member_at(found.rank) if found is not None else None
            if w is None or w.ready == self.world.gen:
                found = None
        if found is not None:
            self._stop_stalled(found.rank, found.how)

    def _stop_stalled(self, rank: int, how: str) -> None:
        w = self._member_at(rank)
        if w is None or w.stalled:
            return
        w.stalled = how
        note(f"worker {w.wid} (process [{w.number}], rank {rank}) on host {w.host}: {how}; stopping it")
        w.agent.send({"t": protocol.STOP, "grace": 0, "r": [w.number]})

    def _post_ended(self, w: Worker, how: str) -> None:
        """Tell the newest world's ranks that ``w`` is gone (their collectives with it fail at once)."""
        if self.world is None or not self._member(w) or self.store is None:
            return
        job = ep.world_job_id(self.job_id, self.world.gen)
        rank = self.world.rank_of(w.wid)
        try:
            self.store.set(protocol.board_key(job, protocol.ENDED, rank=rank), how)
            self.store.add(protocol.board_key(job, protocol.ENDS), 1)
        except Exception as exc:
            log.debug("board: cannot post the end of rank %s: %s", rank, exc)

    def _fail(self, summary: str, worker: Worker | None = None, code: int | None = None) -> None:
        """End the job: ``summary`` is its last line, ``worker`` the failure whose report explains it, ``code`` the
        exit status (default: that worker's, else 1)."""
        if self.failure is not None or self._stop_deadline is not None:
            return
        if code is None:
            code = procs.exit_status(worker.state.code, worker.state.sig) if worker is not None else 1
        self.failure = _Failure(summary, worker, code or 1)
        if worker is not None:
            how = worker.state.how or procs.describe_exit(worker.state.code, worker.state.sig)
            self.console.flush()
            lines = output.failure_report(worker.number, worker.host, how, list(self.console.tails[worker.number]),
                                          sum(1 for w in self.workers.values() if w.alive))
            lines[0] = (f"hora run: the last failure: worker {worker.wid} (process [{worker.number}]) on host "
                        f"{worker.host}: {how}")
            output.print_lines(lines)
        if self.stats.failures:
            note(f"failures: {'; '.join(self.stats.failures[-10:])}")
        self._stop_all()

    def _stop_all(self) -> None:
        if self._stop_deadline is None:
            self._stop_deadline = stop_agents(self.agents, self.cfg.grace)

    def _force_kill(self) -> None:
        """Kill every agent (see :func:`force_kill`); workers still alive count as stopped."""
        force_kill(self.agents, (w.state for w in self.workers.values()))
