"""The driver of an elastic ``hora run`` job: hosts come and go, workers die, training goes on.

It runs the contract of :mod:`hora.protocol.elastic` from the launcher's side:

* hosts: the discovery script runs about once a second (or the fixed ``-H``/``--hostfile`` hosts are used);
  the first world waits for ``-np`` slots, then every available slot up to ``--max-np`` gets a worker.
* a host added: workers start on it (one agent per batch of workers) while the others keep training; once
  they posted ready, an ``update`` (added) makes the members reset at their next commit, and the next world
  holds them too.
* a host removed: an ``update`` (removed); the next world leaves its workers out; they exit 0 (or are
  stopped after a grace). When they are the last members (every other host went too), they hand the state
  over first: they wait (up to ``--elastic-timeout``) for new workers, form one world with them, and leave
  at its first commit.
* a worker that dies or raises: ``ended/<rank>`` goes onto the newest world's board at once (its peers'
  collectives fail with ``HorovodInternalError``), its host is blacklisted (cooldown with backoff when a
  range is given): no new worker starts there meanwhile, but the host's other workers are healthy and stay
  (they may hold the only copy of the state, e.g. on one machine); once every survivor posted ready the
  next world goes out without the failed one.
* a member frozen (stopped, stuck in a native call, cut off): the newest world's board is read as the fixed
  driver reads it (:mod:`hora.launcher.stall_watch`): its agent says what its process is doing; past the stall
  shutdown time (``--stall-check-shutdown-time-seconds``), once its peers gave up on it (they reset) or it
  holds up a data transfer, it is stopped as a failed worker (its host blacklisted) and the others go on.
* a member of a new world that ends before the world's process groups stand: ``ended/<rank>`` on that world's
  board makes the other members give up that world at once and post ready again (``hora.runtime.lifecycle``).
* the job fails, with one line and the root cause's report, when fewer than ``--min-np`` slots stay
  available for ``--elastic-timeout``, when more than ``--reset-limit`` resets happen, when every host is
  blacklisted for good, or when no worker of a world survives (no state to go on from). It succeeds when the
  members of the last world have all exited 0. Every agent is stopped at the end: no process is left.

The job's phase is one :class:`Phase` (:attr:`ElasticDriver.phase`); each look at the job does what its phase
asks, as torch's elastic agent's ``_invoke_run`` does with its ``WorkerState``:

* ``STARTING``: no world yet; world 1 is published once the first workers posted ready.
* ``TRAINING``: the newest world trains; newcomers that posted ready are announced (an ``update``). A member
  that dies or leaves, or one that posts ready for the next world, makes it ``RESETTING``.
* ``RESETTING``: once every member posted ready (within --elastic-timeout of the reset), the next world goes out
  (``TRAINING`` again), with the ready newcomers; ``HANDING_OVER`` when every member left is on a removed host.
* ``HANDING_OVER``: those members hold the only copy of the state and wait for newcomers to take it.
* ``FINISHING``: a member returned: no more worlds; the others finish too.
* ``FAILED`` (:attr:`ElasticDriver.failure` says why) and ``INTERRUPTED``: every worker is being stopped.

Two waits run beside the phase, each up to --elastic-timeout: fewer slots than needed (``short``), and discovery
listing none of the hosts that hold the state (``unlisted``).

Output lines carry each worker process's number (the first world's processes are numbered like its ranks;
later ones get the next numbers), so a process's lines and log files (``--output-filename``) keep one name
for its whole life while its rank changes.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hora.errors import SetupError, StoreAuthError
from hora.launcher import envvars, output, procs
from hora.launcher.config import ElasticConfig, RunConfig
from hora.launcher.elastic.hosts import (
    DISCOVERY_INTERVAL,
    Absences,
    Discovery,
    DiscoveryError,
    HostManager,
    HostSource,
)
from hora.launcher.elastic.workers import LIMIT_EXIT, JobFailure, Stats, Worker, note
from hora.launcher.hosts import HostSpec, SlotInfo
from hora.launcher.remote.transport import Transport
from hora.launcher.supervision.loop import Handle, JobLoop, record_exit
from hora.launcher.supervision.root_cause import RankState
from hora.launcher.supervision.stall_watch import StallWatch
from hora.protocol import elastic as ep
from hora.protocol import messages as protocol
from hora.protocol import network

log = logging.getLogger(__name__)
# Seconds between two looks for hosts; read at each look (Horovod's name for it: this module is also
# horovod.runner.elastic.driver under the stand-in, where tests patch it).
DISCOVER_HOSTS_FREQUENCY_SECS = DISCOVERY_INTERVAL

TICK = 0.05  # seconds between two looks at the store (ready keys) when nothing else happens
# ... while nothing is under way (every worker trains in the newest world, no update or loss pending): as the
# fixed driver's. A look costs two store round trips per worker, and in a job whose workers fill every core
# the launcher's CPU comes out of their steps (docs/performance.md, "The measurements behind design choices").
# Events (a worker's exit, discovery, output) still wake the loop at once; only a reset nobody announced
# (a stall shutdown, a broken link) is seen up to this much later.
STEADY_TICK = 0.5
LEAVE_GRACE = 10.0  # a removed worker that has not exited this long after the world without it is stopped


class Phase(enum.Enum):
    """Where an elastic job stands (see the module docstring)."""

    STARTING = "starting"  # no world yet
    TRAINING = "training"  # the newest world trains
    RESETTING = "resetting"  # the next world is due: waiting for every member to post ready
    HANDING_OVER = "handing over"  # every member left is on a removed host: waiting for newcomers
    FINISHING = "finishing"  # a member returned: no more worlds
    FAILED = "failed"  # the job failed: every worker is being stopped
    INTERRUPTED = "interrupted"  # Ctrl-C or a scheduler's signal: every worker is being stopped


RESETS = (Phase.RESETTING, Phase.HANDING_OVER)
STOPPED = (Phase.FAILED, Phase.INTERRUPTED)


@dataclass
class Wait:
    """A condition the job waits out, up to --elastic-timeout: since when it has held (None: it does not)."""

    since: float | None = None

    def begin(self, now: float) -> bool:
        """It holds at ``now``; True the first time (say so once)."""
        if self.since is None:
            self.since = now
            return True
        return False

    def end(self) -> bool:
        """It no longer holds; True if it did."""
        held, self.since = self.since is not None, None
        return held

    def over(self, now: float, limit: float) -> bool:
        """It has held longer than ``limit`` seconds."""
        return self.since is not None and now - self.since > limit


@dataclass(frozen=True)
class LostMember:
    """A member of a world that failed: the world, its rank there, the worker."""

    gen: int
    rank: int
    worker: Worker


class ElasticDriver(JobLoop):
    """Runs an elastic job: see the module docstring. The loop, Ctrl-C and the end are :class:`JobLoop`'s; this
    class is its steps for a job whose worlds change, made of its parts: the hosts (:class:`HostManager`,
    :class:`Discovery`, :class:`Absences`), the workers (:class:`Worker`, by number) and the worlds it publishes.
    A cluster framework's driver (``hora.ray``) defines its own :meth:`store_address` and :meth:`launch`, and sets
    :attr:`discovery`.

    Args:
        cfg: the checked job (``cfg.elastic`` set).
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the rendezvous store before any worker starts (``hora.run`` ships its
            function through it).
    """

    noun = "worker"

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None,
                 store_ready: Callable[[Any], None] | None = None) -> None:
        super().__init__(cfg, transport_for=transport_for, store_ready=store_ready)
        assert cfg.elastic is not None
        self.ecfg: ElasticConfig = cfg.elastic
        self.phase = Phase.STARTING
        self.phase_since = 0.0  # when the job entered its phase (a reset's deadline runs from it)
        self.failure: JobFailure | None = None  # why the job failed (phase FAILED)
        self.hostman = HostManager(self.ecfg.cooldown)
        self.workers: dict[int, Worker] = {}  # by number
        self.world: ep.World | None = None
        self.member_numbers: set[int] = set()  # the worker processes of the newest world
        self.lost: list[LostMember] = []  # every member that failed, in order
        self.updates = 0  # the value of the store's ``updates`` counter
        self._discovered = 0  # the value of the store's ``discovered`` counter
        self.stalls = StallWatch(None, "", {})  # the newest world's board (see _watch_stalls)
        self.stats = Stats()
        # the --host-discovery-script, when the job has one (a cluster framework's driver sets its own source)
        self.discovery: HostSource | None = None
        self.absences = Absences()  # hosts discovery left out, until their removal is confirmed
        self.short = Wait()  # fewer slots available than the job needs (-np, then --min-np)
        self.unlisted = Wait()  # discovery lists no host of the newest world's workers
        self._published_ts = 0.0  # wall-clock time the newest world was published
        self._start_deadline = 0.0
        self._discovery_done = threading.Event()
        self._last: Worker | None = None  # the last worker that failed (the root cause of a job failure)

    def _enter(self, phase: Phase) -> None:
        if phase is not self.phase:
            log.debug("elastic job: %s -> %s", self.phase.value, phase.value)
            self.phase, self.phase_since = phase, time.monotonic()

    # --- the newest world and its members --------------------------------------------------------------
    def _key(self, key: str, **fields: object) -> str:
        return ep.elastic_key(self.job_id, key, **fields)

    def member(self, w: Worker) -> bool:
        """``w`` (this process, not an earlier one with its id) is in the newest world."""
        return w.number in self.member_numbers

    def _members(self) -> list[Worker]:
        """The live workers of the newest world that will be in the next one."""
        if self.world is None:
            return []
        return [w for w in self.workers.values() if w.alive and not w.leaving and self.member(w)]

    def _previous(self, keep: list[Worker]) -> ep.World | None:
        """The newest world reduced to the members in ``keep``: what new ranks are ordered by (a new process
        that reuses the id of a member that died is new, never the holder of the state)."""
        if self.world is None:
            return None
        ids = {w.wid for w in keep if self.member(w)}
        return ep.World(self.world.gen, {k: v for k, v in self.world.workers.items() if k in ids}, self.world.updates)

    def _newcomers(self) -> list[Worker]:
        """Live workers not in the newest world that posted ready and may join."""
        return [w for w in self.workers.values()
                if w.alive and not w.leaving and w.ready is not None and not self.member(w)]

    def _carriers(self) -> list[Worker]:
        """The live workers of the newest world on hosts that discovery removed (they leave gracefully)."""
        return [w for w in self.workers.values() if w.alive and w.leaving and self.member(w)]

    def _steady(self) -> bool:
        """Nothing is under way: the newest world trains, every live worker is a member of it and has not posted
        ready for the next one, no announced host change waits for its world, nobody is leaving."""
        world = self.world
        if self.phase is not Phase.TRAINING or self.stopping or world is None or self.updates > world.updates:
            return False
        return all(self.member(w) and not w.leaving and w.leave_by is None and w.ready != world.gen
                   for w in self.workers.values() if w.alive)

    def _member_at(self, rank: int) -> Worker | None:
        """The live worker with rank ``rank`` in the newest world."""
        if self.world is None:
            return None
        return next((w for w in self._members() if self.world.rank_of(w.wid) == rank), None)

    def _member_lost(self) -> None:
        """A member of the newest world died or left: the next world is due."""
        if self.phase is Phase.TRAINING:
            self._enter(Phase.RESETTING)

    # --- failing and stopping the job ------------------------------------------------------------------
    def _watch_stalls(self) -> None:
        """The newest world's board, as the fixed driver reads it (:mod:`hora.launcher.supervision.stall_watch`):
        the silent peers of waiting ranks are probed by their agents; a member that the stall shutdown time gave
        up on (frozen in a data transfer, or named by the ranks that stopped waiting for it and reset) is stopped
        as a failed worker: its host is blacklisted and the next world goes on without it."""
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
        if self.world is None or not self.member(w) or self.store is None:
            return
        job = ep.world_job_id(self.job_id, self.world.gen)
        rank = self.world.rank_of(w.wid)
        try:
            self.store.set(protocol.board_key(job, protocol.ENDED, rank=rank), how)
            self.store.add(protocol.board_key(job, protocol.ENDS), 1)
            # members still waiting in init() for the world's others to arrive stop waiting (runtime.arrivals)
            self.store.set(ep.arrivals_key(self.job_id, self.world.gen), ep.MEMBER_ENDED)
        except Exception as exc:
            log.debug("board: cannot post the end of rank %s: %s", rank, exc)

    def _fail(self, summary: str, worker: Worker | None = None, code: int | None = None) -> None:
        """End the job: ``summary`` is its last line, ``worker`` the failure whose report explains it, ``code`` the
        exit status (default: that worker's, else 1)."""
        if self.failure is not None or self.stopping:
            return
        if code is None:
            code = procs.exit_status(worker.state.code, worker.state.sig) if worker is not None else 1
        self.failure = JobFailure(summary, worker, code or 1)
        self._enter(Phase.FAILED)
        if worker is not None:
            how = worker.state.describe()
            self.console.flush()
            lines = output.failure_report(worker.number, worker.host, how, list(self.console.tails[worker.number]),
                                          sum(1 for w in self.workers.values() if w.alive and w is not worker))
            lines[0] = (f"hora run: the last failure: worker {worker.wid} (process [{worker.number}]) on host "
                        f"{worker.host}: {how}")
            output.print_lines(lines)
        if self.stats.failures:
            note(f"failures: {'; '.join(self.stats.failures[-10:])}")
        self.stop_all()

    # --- the rendezvous store --------------------------------------------------------------------------
    def store_address(self, hosts: list[HostSpec]) -> str:
        """The address the job's store listens on: the one this machine reaches ``hosts`` from."""
        return network.store_address([h.name for h in hosts if not h.is_local], self.cfg.network_interfaces)

    def _read_ready(self) -> None:
        for w in self.workers.values():
            if not w.alive or (w.leaving and not self.member(w)):  # a removed member may hand the state over
                continue
            want = self.world.gen if self.world is not None and self.member(w) else None
            if w.ready is not None and (want is None or w.ready == want):
                continue  # nothing new can be in the key until the next world
            key = self._key(ep.READY, worker_id=w.wid)
            try:
                if self.store.check([key]):
                    w.ready = int(self.store.get(key).decode())
            except StoreAuthError as exc:  # a stranger wrote it: which world the worker waits for is unknown
                self._fail(str(exc))
                return
            except Exception as exc:  # our own store: fails only while shutting down
                log.debug("cannot read %s: %s", key, exc)

    def _post_discovery(self, change: ep.Update) -> None:
        """Tell rank 0 at once what discovery found (Horovod's ``state._host_messages``)."""
        self._discovered += 1
        self.store.set(self._key(ep.DISCOVERY, n=self._discovered), change.to_json())

    def _post_update(self, update: ep.Update) -> None:
        n = self.updates + 1
        self.store.set(self._key(ep.UPDATE, n=n), update.to_json())
        self.updates = n
        log.info("update %d: %s", n, update)

    # --- slots -----------------------------------------------------------------------------------------
    def _slots_wanted(self, now: float) -> list[tuple[str, int]]:
        """``(host, slot)`` of every slot that should hold a worker now: the slots of the running workers that
        stay (a blacklisted host's healthy workers keep theirs: the blacklist decides where new workers start,
        not who is stopped), then the free slots of the available hosts, in order; at most --max-np (running
        workers first, so a cap never evicts one)."""
        running = [(w.host, ep.parse_worker_id(w.wid)[1]) for w in self.workers.values() if w.alive and not w.leaving]
        held = set(running)
        free = [(h.name, s) for h in self.hostman.available(now) for s in range(h.slots) if (h.name, s) not in held]
        cap = self.ecfg.max_np
        return (running + free) if cap is None else (running + free)[:cap]

    def _check_hopeless(self, now: float) -> bool:
        """Fail the job when it cannot go on; True when it failed."""
        alive = [w for w in self.workers.values() if w.alive and not w.leaving]
        if self.hostman.all_blacklisted_for_good(now) and not alive:
            self._fail(f"every host is blacklisted ({', '.join(self.hostman.hosts)}): a worker failed on each of "
                       "them" + ("" if self.ecfg.cooldown else " (give --blacklist-cooldown-range to let hosts "
                                 "come back)"), self._last)
            return True
        first = self.stats.started == 0
        need, flag = (self.cfg.np, "-np") if first else (self.ecfg.min_np, "--min-np")
        have = len(self._slots_wanted(now))
        if have >= need:
            self.short.end()
            return False
        if self.short.begin(now):
            note(f"{have} slot{'s' if have != 1 else ''} available, fewer than the {need} of {flag}; waiting up "
                 f"to --elastic-timeout {self.ecfg.elastic_timeout:g}s for hosts")
        if self.short.over(now, self.ecfg.elastic_timeout):
            blacklisted = [n for n in self.hostman.hosts if self.hostman.is_blacklisted(n, now)]
            extra = f"; blacklisted: {', '.join(blacklisted)}" if blacklisted else ""
            self._fail(f"fewer than {need} slots ({flag}) for --elastic-timeout {self.ecfg.elastic_timeout:g}s: "
                       f"{have} available (hosts: {', '.join(self.hostman.hosts) or 'none'}{extra})", self._last,
                       LIMIT_EXIT)
            return True
        return False

    # --- hosts -----------------------------------------------------------------------------------------
    def _confirmed(self, found: tuple[HostSpec, ...], now: float) -> tuple[HostSpec, ...]:
        """A discovery answer, with the hosts it left out kept until their removal is confirmed: left out of
        :data:`~hora.launcher.elastic.hosts.REMOVAL_ANSWERS` answers in a row, and, for the hosts of every worker of
        the newest world (they hold the only copy of the training state), not before other hosts can take the
        state over: until then they go on training, up to --elastic-timeout."""
        listed = {h.name for h in found}
        confirmed = set(self.absences.look(listed, list(self.hostman.hosts)))
        kept = [HostSpec(n, s) for n, s in self.hostman.hosts.items() if n not in listed and n not in confirmed]
        carriers = sorted({w.host for w in self._members()}) if self.phase is not Phase.FINISHING else []
        others = [h for h in found if h.name not in carriers and not self.hostman.is_blacklisted(h.name, now)]
        if carriers and set(carriers) <= confirmed and not others:
            if self.unlisted.begin(now):
                note(f"discovery lists none of the hosts of world {self.world.gen if self.world else 0}'s workers "
                     f"({', '.join(carriers)}), which hold the training state: they go on until discovery lists "
                     "their hosts again or other hosts can take the state over (up to --elastic-timeout "
                     f"{self.ecfg.elastic_timeout:g}s)")
            elif self.unlisted.over(now, self.ecfg.elastic_timeout):
                self._fail(f"discovery has listed none of the hosts of the workers that hold the training state "
                           f"({', '.join(carriers)}) and no other host for --elastic-timeout "
                           f"{self.ecfg.elastic_timeout:g}s; check the --host-discovery-script", code=LIMIT_EXIT)
            kept += [HostSpec(n, self.hostman.hosts[n]) for n in carriers]
        elif self.unlisted.end():
            back = [n for n in carriers if n in listed]
            if back:
                note(f"discovery lists {', '.join(back)} again: their workers go on")
        return tuple(found) + tuple(kept)

    def _on_hosts(self, found: tuple[HostSpec, ...]) -> None:
        found = self._confirmed(found, time.monotonic())
        old_slots = dict(self.hostman.hosts)
        added, removed = self.hostman.update(found)
        shrunk = [h.name for h in found if h.name in old_slots and h.slots < old_slots[h.name]]
        if added:
            note(f"hosts added: {', '.join(added)}")
        if removed:
            note(f"hosts removed: {', '.join(removed)}")
        if added or removed:
            self._post_discovery(ep.Update(added=tuple(added), removed=tuple(removed)))
        gone = set(removed)
        leaving_members = []
        for w in self.workers.values():
            if not w.alive or w.leaving:
                continue
            host, slot = ep.parse_worker_id(w.wid)
            if host in gone or (host in shrunk and slot >= self.hostman.hosts[host]):
                self._let_go(w)
                if self.member(w):
                    leaving_members.append(w.host)
        if leaving_members and self.phase is not Phase.FINISHING:
            self._post_update(ep.Update(removed=tuple(dict.fromkeys(leaving_members))))

    def _let_go(self, w: Worker) -> None:
        """No world will hold ``w`` again: it exits 0 when it sees the next world (or is stopped)."""
        w.leaving = True
        if not self.member(w):
            w.leave_by = time.monotonic()  # not a member: nothing to wait for
        else:
            self._member_lost()

    # --- publishing worlds: one step per phase ---------------------------------------------------------
    def _train(self, now: float) -> None:
        """TRAINING: announce the newcomers that posted ready (an update: the members reset at their next commit);
        a member that posted ready for the next world makes the reset due."""
        assert self.world is not None
        if any(w.ready == self.world.gen for w in self._members()):
            self._enter(Phase.RESETTING)
            self._reset(now)
            return
        fresh = [w for w in self._newcomers() if not w.announced]
        # workers started together join together (one reset, not one per worker), unless some take longer than
        # --start-timeout to get ready
        if fresh and not self._starting(now):
            self._post_update(ep.Update(added=tuple(dict.fromkeys(w.host for w in fresh))))
            for w in fresh:
                w.announced = True

    def _starting(self, now: float) -> list[Worker]:
        """Live workers started within --start-timeout that have not posted ready yet."""
        return [w for w in self.workers.values() if w.alive and not w.leaving and w.ready is None
                and now - w.started_at < self.cfg.start_timeout]

    def _reset(self, now: float) -> None:
        """RESETTING, HANDING_OVER: publish the next world once every member (or, when only removed hosts' members
        are left, every carrier of the state and a newcomer) posted ready, within --elastic-timeout."""
        assert self.world is not None
        members = self._members()
        carriers = [] if members else self._carriers()
        if not members and not carriers:
            self._fail(f"no worker of world {self.world.gen} is left to carry the training state "
                       f"(hosts {', '.join(self.world.hosts())} all failed or were removed); a new world must keep "
                       "at least one worker of the old one", self._last)
            return
        late = [w for w in members or carriers if w.ready != self.world.gen]
        if late:
            if now - self.phase_since > self.ecfg.elastic_timeout:
                names = ", ".join(f"rank {self.world.rank_of(w.wid)} ({w.wid})" for w in late)
                self._fail(f"{names} did not reset within --elastic-timeout {self.ecfg.elastic_timeout:g}s "
                           "(stuck outside hvd.elastic.run's reset?)")
            return
        newcomers = self._newcomers()
        if carriers and not self._ready_to_take_over(now, carriers, newcomers):
            return
        chosen = (members + newcomers)[:self.ecfg.max_np]  # handing over: the newcomers (carriers added below)
        if len(chosen) < self.ecfg.min_np:
            return  # more workers may come; _check_hopeless applies the elastic timeout
        if carriers:
            chosen = carriers + chosen
        if self.ecfg.reset_limit is not None and self.stats.resets >= self.ecfg.reset_limit:
            self._reset_limit_reached()
            return
        self._publish(chosen)
        if carriers:  # they leave at the world's first commit, once the newcomers hold the state
            self._post_update(ep.Update(removed=tuple(dict.fromkeys(w.host for w in carriers))))

    def _reset_limit_reached(self) -> None:
        """Another reset is due and the job has had --reset-limit of them: it ends, with the limit's exit status
        and, when a failure made the reset due, that failure's report."""
        done, limit = self.stats.resets, self.ecfg.reset_limit
        last = self._last
        trigger = last if last is not None and last.state.exit_ts >= self._published_ts else None
        why = f"worker {trigger.wid} failed" if trigger is not None else "the hosts changed"
        self._fail(f"--reset-limit {limit} reached: the job has reset {done} time{'s' if done != 1 else ''} and "
                   f"{why}, which needs another reset; it stops here (exit code {LIMIT_EXIT})", trigger, LIMIT_EXIT)

    def _ready_to_take_over(self, now: float, carriers: list[Worker], newcomers: list[Worker]) -> bool:
        """Every member left is on a removed host: its workers hand the training state over before they leave.
        True once new workers are ready to take it (those started together, unless some take longer than
        --start-timeout); the job fails if none is within --elastic-timeout of the reset."""
        if newcomers and not self._starting(now):
            return True
        if self.phase is not Phase.HANDING_OVER:
            since = self.phase_since
            self._enter(Phase.HANDING_OVER)
            self.phase_since = since  # the reset's deadline goes on
            note(f"hosts {', '.join(dict.fromkeys(w.host for w in carriers))} removed: their workers hold the training "
                 f"state and wait for new workers to take it (up to --elastic-timeout {self.ecfg.elastic_timeout:g}s)")
        if now - self.phase_since > self.ecfg.elastic_timeout:
            self._fail(f"the workers of removed hosts ({', '.join(w.wid for w in carriers)}) hold the only copy of "
                       f"the training state and no new worker was ready to take it within --elastic-timeout "
                       f"{self.ecfg.elastic_timeout:g}s; add hosts sooner, or give a longer --elastic-timeout")
        return False

    def _publish_first(self, now: float) -> None:
        """STARTING: world 1 is every started worker once all posted ready; after --start-timeout, those that did
        (if they are --min-np or more: the late ones join at a later world)."""
        waiting = [w for w in self.workers.values() if w.alive and not w.leaving]
        ready = [w for w in waiting if w.ready is not None]
        if not ready or (len(ready) < len(waiting) and now < self._start_deadline):
            return
        if len(ready) < self.ecfg.min_np:
            if now > self._start_deadline + self.ecfg.elastic_timeout:
                late = ", ".join(w.wid for w in waiting if w.ready is None)
                self._fail(f"only {len(ready)} of the {len(waiting)} workers called hvd.init() within --start-timeout "
                           f"{self.cfg.start_timeout:g}s + --elastic-timeout {self.ecfg.elastic_timeout:g}s "
                           f"(--min-np {self.ecfg.min_np}); late: {late}")
            return
        self._publish(ready[:self.ecfg.max_np] if self.ecfg.max_np else ready)

    def _publish(self, chosen: list[Worker]) -> None:
        previous = self.world
        gen = (previous.gen if previous else 0) + 1
        world = ep.assign_world(self._previous(chosen), gen, [(w.wid, w.host) for w in chosen], updates=self.updates)
        self.store.set(self._key(ep.WORLD, gen=gen), world.to_json())
        self.store.set(self._key(ep.GEN), str(gen))
        self.world = world
        self.member_numbers = {w.number for w in chosen}
        self.stalls = StallWatch(self.store, ep.world_job_id(self.job_id, gen),
                                 {p.rank: p.hostname for p in world.workers.values()})
        self._enter(Phase.TRAINING)
        self._published_ts = time.time()
        if previous is not None:
            self.stats.resets += 1
        for w in chosen:
            w.announced = False
        leave_by = time.monotonic() + LEAVE_GRACE
        for w in self.workers.values():
            if w.alive and w.leaving and w.leave_by is None and w.number not in self.member_numbers:
                w.leave_by = leave_by
        old = previous.worker_ids() if previous else []  # in rank order, so the line reads the same every time
        joined = [wid for wid in world.worker_ids() if wid not in old]
        left = [wid for wid in old if wid not in world.workers]
        what = f"world {gen}: {world.size} worker{'s' if world.size != 1 else ''} on {', '.join(world.hosts())}"
        if previous is not None:
            what += "".join([f"; joined: {', '.join(joined)}" if joined else "",
                             f"; left: {', '.join(left)}" if left else ""])
        note(what)

    # --- the loop's steps ----------------------------------------------------------------------------------
    def set_up(self) -> None:
        self.start_store(self.store_address(self._first_hosts()))
        self._start_deadline = time.monotonic() + self.cfg.start_timeout
        self.short.begin(time.monotonic())  # the first world waits for -np slots (said only if it must wait again)

    def stop(self) -> None:
        self._discovery_done.set()
        if self.discovery is not None:
            self.discovery.stop()

    def wait_s(self) -> float:
        return STEADY_TICK if self._steady() else TICK

    def over(self) -> bool:
        dead = all(not w.alive for w in self.workers.values())
        if self.stopping:
            return dead and all(h.finished for h in self.handles)
        return self.phase is Phase.FINISHING and dead

    def look(self, now: float) -> None:
        """One look at the job: what its phase asks (see the module docstring)."""
        if self.stopping and self.phase not in STOPPED:
            self._enter(Phase.INTERRUPTED)  # a signal stopped every worker (a failure entered FAILED itself)
        if self.phase in STOPPED:
            return
        if self.phase is not Phase.FINISHING:
            self._stop_late_leavers(now)
            self._read_ready()
            self._watch_stalls()
            if not self._check_hopeless(now):
                self._start_missing(now)
                if self.phase is Phase.STARTING:
                    self._publish_first(now)
                elif self.phase is Phase.TRAINING:
                    self._train(now)
                elif self.phase in RESETS:
                    self._reset(now)
        self.console.release_stale([w.number for w in self.workers.values() if not w.alive])

    def on_event(self, kind: str, value: Any) -> None:
        if kind == "hosts":
            self._on_hosts(value)
        elif kind == "discovery_error":
            log.warning("%s (keeping the last hosts)", value)

    def processes(self) -> Iterable[RankState]:
        return (w.state for w in self.workers.values())

    def killed_label(self, state: RankState) -> str:
        w = next(w for w in self.workers.values() if w.state is state)
        return f"worker {w.wid} (process [{w.number}]) on host {w.host}"

    def _first_hosts(self) -> list[HostSpec]:
        """The hosts known before the store starts (it must listen on an address they reach)."""
        if self.discovery is None and self.ecfg.discovery_script is None:
            self.hostman.update(self.cfg.hosts)
            return list(self.cfg.hosts)
        if self.discovery is None:
            assert self.ecfg.discovery_script is not None
            self.discovery = Discovery(self.ecfg.discovery_script, self.ecfg.slots_per_host, self.cfg.cwd)
        try:
            found = self.discovery.run()
        except DiscoveryError as exc:
            raise SetupError(f"{exc}; fix the script (it prints one 'host' or 'host:slots' line per host)") from None
        self.hostman.update(found)
        threading.Thread(target=self._discover_loop, daemon=True, name="hora-discovery").start()
        return list(found)

    def _discover_loop(self) -> None:
        """Run the discovery script about once a second; each result (or failure) becomes an event."""
        assert self.discovery is not None
        while not self._discovery_done.is_set():
            began = time.monotonic()
            try:
                self.events.put(("hosts", -1, self.discovery.run()))
            except DiscoveryError as exc:
                self.events.put(("discovery_error", -1, str(exc)))
            self._discovery_done.wait(max(0.0, DISCOVER_HOSTS_FREQUENCY_SECS - (time.monotonic() - began)))

    def _stop_late_leavers(self, now: float) -> None:
        for w in self.workers.values():
            if w.alive and w.leave_by is not None and now > w.leave_by:
                w.leave_by = None
                log.info("worker %s (%d) did not leave by itself: stopping it", w.wid, w.number)
                w.agent.send({"t": protocol.STOP, "grace": self.cfg.grace, "r": [w.number]})

    # --- starting workers ------------------------------------------------------------------------------
    def _start_missing(self, now: float) -> None:
        """Start workers on wanted slots that have none (never before the first world's -np slots exist)."""
        wanted = self._slots_wanted(now)
        if self.world is None and self.stats.started == 0 and len(wanted) < self.cfg.np:
            return  # the first world waits for -np slots (the elastic timeout applies: _check_hopeless)
        running = {w.wid for w in self.workers.values() if w.alive}
        missing = [(h, s) for h, s in wanted if ep.worker_id(h, s) not in running]
        if not missing:
            return
        by_host: dict[str, list[int]] = {}
        for host, slot in missing:
            by_host.setdefault(host, []).append(slot)
        base = (self._members() or self._carriers()) + [w for w in self.workers.values() if w.alive and not w.leaving
                                                         and not self.member(w)]
        plan = ep.assign_world(self._previous(base), (self.world.gen if self.world else 0) + 1,
                               [(w.wid, w.host) for w in base] + [(ep.worker_id(h, s), h) for h, s in missing])
        for host, host_slots in by_host.items():
            self._start_workers(host, host_slots, plan)

    def _start_workers(self, host: str, slots: list[int], plan: ep.World) -> None:
        """The workers of ``slots`` on ``host``, started together; their start values come from ``plan``."""
        launch: list[tuple[int, int, dict[str, str]]] = []
        placed: list[tuple[str, int, SlotInfo]] = []
        for slot in slots:
            wid = ep.worker_id(host, slot)
            p = plan.workers[wid]
            number = self.stats.started
            self.stats.started += 1
            info = SlotInfo(rank=p.rank, size=plan.size, local_rank=p.local_rank, local_size=p.local_size,
                            cross_rank=p.cross_rank, cross_size=p.cross_size, hostname=host, host_index=0)
            env = envvars.rank_env(info, store_addr=self.addr, store_port=self.port, job_id=self.job_id)
            env.update({ep.ELASTIC_ENV: "1", ep.WORKER_ID_ENV: wid,
                        # the worker's own deadline for a world that holds it (hvd.elastic's reset)
                        "HORA_ELASTIC_TIMEOUT": f"{self.ecfg.elastic_timeout:g}"})
            try:
                self.store.delete_key(self._key(ep.READY, worker_id=wid))  # a previous process's answer
            except Exception as exc:
                log.debug("cannot clear the ready key of %s: %s", wid, exc)
            launch.append((number, slot, env))
            placed.append((wid, number, info))
        handle = self.launch(host, launch)
        new = [Worker(wid, host, number, handle, RankState(info)) for wid, number, info in placed]
        for w in new:
            self.workers[w.number] = w
            if self.cfg.output_filename:
                self.console.open_logs(range(w.number, w.number + 1), strict=False)
        log.info("host %s: starting workers %s", host, ", ".join(w.wid for w in new))

    def launch(self, host: str, workers: list[tuple[int, int, dict[str, str]]]) -> Handle:
        """Start the worker processes ``workers`` (``(number, slot, variables)`` each) on ``host``: one agent
        for them. A cluster framework's driver starts them its own way (``hora.ray``: one actor each)."""
        spec = self.agent_spec(host, [{"rank": number, "env": env} for number, _, env in workers],
                               unset=(ep.ELASTIC_ENV, ep.WORKER_ID_ENV))
        return self.start_agent(host, HostSpec(host, 1).is_local, [number for number, _, _ in workers], spec)

    # --- workers' ends ---------------------------------------------------------------------------------
    def on_message(self, handle: Handle, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == protocol.EXIT:
            w = self.workers[int(message["r"])]
            state = w.state
            record_exit(state, message)
            if w.stalled and not self.stopping:  # the stall inspector's stop: a failure
                state.stopped, state.how = False, w.stalled
            self._on_exit(w)
        elif kind == protocol.PROBE and not self.stopping and self.world is not None:
            w = self.workers[int(message["r"])]
            rank = self.world.rank_of(w.wid) if self.member(w) else None
            if rank is not None:
                output.note(self.stalls.on_probe(rank, str(message.get("how", ""))))

    def on_handle_gone(self, handle: Handle, code: int) -> None:
        lost = [self.workers[n] for n in handle.ranks if self.workers[n].alive]
        if not lost:
            return
        how = handle.lost(code, ", ".join(f"worker {w.wid}" for w in lost))
        for w in lost:
            w.state.done, w.state.code, w.state.exit_ts, w.state.how = True, 1, time.time(), how
            w.state.stopped = self.stopping or w.leaving
            self._on_exit(w)

    def _on_exit(self, w: Worker) -> None:
        state = w.state
        how = state.describe()
        member = self.member(w)
        self._post_ended(w, how)
        if w.leaving and state.failed and not state.stopped and not self.stopping:
            self.console.release(w.number)  # a removed host's worker that crashed on its way out: no failure
            note(f"worker {w.wid} of removed host {w.host} ended: {how}")
        if not state.failed or state.stopped or w.leaving:
            self.console.rank_done(w.number)
            if member and not w.leaving and not self.stopping and not state.stopped:
                if self.phase is not Phase.FINISHING:
                    log.info("worker %s returned: the job is finishing", w.wid)
                self._enter(Phase.FINISHING)  # training is over: stop whoever has not joined
                for other in self.workers.values():
                    if other.alive and not self.member(other):
                        other.agent.send({"t": protocol.STOP, "grace": self.cfg.grace, "r": [other.number]})
            elif member and not self.stopping:
                self._member_lost()
            return
        if self.stopping:
            self.console.rank_done(w.number, failed=True)
            return
        self.stats.failures.append(f"{w.wid}: {how}")
        rank = self.world.rank_of(w.wid) if member and self.world is not None else None
        if rank is not None and self.world is not None:
            self.lost.append(LostMember(self.world.gen, rank, w))
        who = f"worker {w.wid} (process [{w.number}]" + (f", rank {rank})" if rank is not None else ")")
        if self.phase is Phase.FINISHING:
            self._fail(f"{who} on host {w.host}: {how} while the job was finishing", w)
            return
        self.console.release(w.number)  # its traceback, as it printed it: the job goes on
        self.console.rank_done(w.number)
        # the blacklist decides where new workers start: the host's other workers are healthy and go on (they
        # may hold the only copy of the training state)
        delay = self.hostman.blacklist(w.host, time.monotonic(), how)
        back = "for good" if delay == float("inf") else f"for {delay:.0f}s"
        # the one line about it: the workers' own "a peer is gone" is a consequence, logged below warning level
        goes_on = ("the others go back to the last commit and go on" if member and self._members()
                   else "the job goes on" if not member else "")
        note(f"{who} on host {w.host} failed: {how}; {goes_on + '; ' if goes_on else ''}host {w.host} blacklisted "
             f"{back} (no new worker starts there)")
        if member:
            self._member_lost()
        self._last = w

    # --- the end ---------------------------------------------------------------------------------------
    def failed_status(self) -> int | None:
        if self.failure is None:
            return None
        output.note(f"job failed: {self.failure.summary}")
        return self.failure.code

    def final_status(self) -> int:
        final = [w for w in self.workers.values() if self.member(w) and not w.leaving]
        bad = [w for w in final if w.state.failed]
        if bad:
            w = bad[0]
            output.note(f"job failed: worker {w.wid}: {procs.describe_exit(w.state.code, w.state.sig)}")
            return procs.exit_status(w.state.code, w.state.sig) or 1
        if self.stats.resets:
            note(f"done: {self.stats.resets} reset{'s' if self.stats.resets != 1 else ''}, "
                 f"{len(self.stats.failures)} failure{'s' if len(self.stats.failures) != 1 else ''}")
        return 0
