"""The driver of an elastic ``hora run`` job: hosts come and go, workers die, training goes on.

It runs the contract of :mod:`hora.launch.elastic_protocol` from the launcher's side:

* hosts: the discovery script runs about once a second (or the fixed ``-H``/``--hostfile`` hosts are used);
  the first world waits for ``-np`` slots, then every available slot up to ``--max-np`` gets a worker.
* a host added: workers start on it (one agent per batch of workers) while the others keep training; once
  they posted ready, an ``update`` (added) makes the members reset at their next commit, and the next world
  holds them too.
* a host removed: an ``update`` (removed); the next world leaves its workers out; they exit 0 (or are
  stopped after a grace).
* a worker that dies or raises: ``ended/<rank>`` goes onto the newest world's board at once (its peers'
  collectives fail with ``HorovodInternalError``), its host is blacklisted (cooldown with backoff when a
  range is given), the host's other workers are stopped, and once every survivor posted ready the next
  world goes out without them.
* the job fails, with one line and the root cause's report, when fewer than ``--min-np`` slots stay
  available for ``--elastic-timeout``, when more than ``--reset-limit`` resets happen, when every host is
  blacklisted for good, or when no worker of a world survives (no state to go on from). It succeeds when the
  members of the last world have all exited 0. Every agent is stopped at the end: no process is left.

Output lines carry each worker process's number (the first world's processes are numbered like its ranks;
later ones get the next numbers), so a process's lines and log files (``--output-filename``) keep one name
for its whole life while its rank changes.
"""

from __future__ import annotations

import datetime
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hora import env as hora_env
from hora import network
from hora.errors import SetupError
from hora.launch import elastic_protocol as ep
from hora.launch import envvars, output, procs, protocol
from hora.launch.agent_handle import KILL_AFTER_GRACE, PING_INTERVAL, AgentHandle, default_transport, split_returncode
from hora.launch.config import RunConfig
from hora.launch.elastic_hosts import (
    DISCOVERY_INTERVAL,
    DiscoveryError,
    ElasticConfig,
    HostManager,
    run_discovery,
)
from hora.launch.failures import RankState
from hora.launch.hosts import HostSpec, SlotInfo
from hora.launch.transport import SSH_FAILED, Transport, agent_argv

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between two looks at the store (ready keys) when nothing else happens
LEAVE_GRACE = 10.0  # a removed worker that has not exited this long after the world without it is stopped


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
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return not self.state.done


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


class ElasticDriver:
    """Runs an elastic job: see the module docstring.

    Args:
        cfg: the checked job (``cfg.elastic`` set).
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
    """

    def __init__(self, cfg: RunConfig, *, transport_for: Callable[[str, bool], Transport] | None = None) -> None:
        assert cfg.elastic is not None
        self.cfg = cfg
        self.ecfg: ElasticConfig = cfg.elastic
        self.transport_for = transport_for or default_transport(cfg)
        self.job_id = ""
        self.store: Any = None
        self.addr, self.port = "", 0
        self.events: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self.hostman = HostManager(self.ecfg.cooldown)
        self.agents: list[AgentHandle] = []
        self.workers: dict[int, Worker] = {}  # by number
        self.world: ep.World | None = None
        self.member_numbers: set[int] = set()  # the worker processes of the newest world
        self.updates = 0  # the value of the store's ``updates`` counter
        self.console = output.Console(prefix_timestamp=cfg.prefix_timestamp, output_dir=cfg.output_filename)
        self.failure: _Failure | None = None
        self.finishing = False  # a member returned: no more worlds, the others finish too
        self.interrupted: int | None = None
        self.stats = _Stats()
        self._signals = 0
        self._stop_deadline: float | None = None
        self._reset_since: float | None = None
        self._lost_member = False  # a member of the newest world died or left: a reset is due
        self._short_since: float | None = None  # since when fewer than --min-np slots are available
        self._start_deadline = 0.0
        self._stopping = threading.Event()
        self._last: Worker | None = None  # the last worker that failed (the root cause of a job failure)

    # --- set-up ----------------------------------------------------------------------------------------
    def _start_store(self, hosts: list[HostSpec]) -> None:
        from torch.distributed import TCPStore  # the only torch import of the launch side

        remote = [h.name for h in hosts if not h.is_local]
        self.addr = network.store_address(remote, self.cfg.network_interfaces)
        self.store = TCPStore(self.addr, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(self.cfg.start_timeout, 60)))
        self.port = int(self.store.port)
        log.info("rendezvous store on %s:%d (job %s)", self.addr, self.port, self.job_id)

    def _key(self, key: str, **fields: object) -> str:
        return ep.elastic_key(self.job_id, key, **fields)

    def _discover_loop(self) -> None:
        """Run the discovery script about once a second; each result (or failure) becomes an event."""
        script = self.ecfg.discovery_script
        assert script is not None
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                self.events.put(("hosts", -1, run_discovery(script, self.ecfg.slots_per_host, self.cfg.cwd)))
            except DiscoveryError as exc:
                self.events.put(("discovery_error", -1, str(exc)))
            self._stopping.wait(max(0.0, DISCOVERY_INTERVAL - (time.monotonic() - began)))

    # --- running ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; return the exit status for the ``hora run`` process."""
        self.job_id = uuid.uuid4().hex[:12]
        hosts = self._first_hosts()
        self._start_store(hosts)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self._loop()
            finally:
                self._stopping.set()
                self._shutdown_agents()
                self.console.close()
            return self._exit_status()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _first_hosts(self) -> list[HostSpec]:
        """The hosts known before the store starts (it must listen on an address they reach)."""
        if self.ecfg.discovery_script is None:
            self.hostman.update(self.cfg.hosts)
            return list(self.cfg.hosts)
        try:
            found = run_discovery(self.ecfg.discovery_script, self.ecfg.slots_per_host, self.cfg.cwd)
        except DiscoveryError as exc:
            raise SetupError(f"{exc}; fix the script (it prints one 'host' or 'host:slots' line per host)") from None
        self.hostman.update(found)
        threading.Thread(target=self._discover_loop, daemon=True, name="hora-discovery").start()
        return list(found)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.events.put(("signal", -1, signum))

    def _loop(self) -> None:
        last_ping = time.monotonic()
        self._start_deadline = time.monotonic() + self.cfg.start_timeout
        self._short_since = time.monotonic()
        while True:
            try:
                kind, index, value = self.events.get(timeout=TICK)
                self._handle(kind, index, value)
                while True:  # a burst of output: drain it before looking at the store again
                    kind, index, value = self.events.get_nowait()
                    self._handle(kind, index, value)
            except queue.Empty:
                self.console.flush()
            now = time.monotonic()
            if self._stop_deadline is not None:
                if all(not w.alive for w in self.workers.values()) and all(a.finished for a in self.agents):
                    return
                if now > self._stop_deadline:
                    self._force_kill()
                    return
                continue
            if self.finishing and all(not w.alive for w in self.workers.values()):
                return
            if not self.finishing:
                self._step(now)
            self.console.release_stale([w.number for w in self.workers.values() if not w.alive])
            if now - last_ping >= PING_INTERVAL:
                last_ping = now
                for agent in self.agents:
                    if not agent.finished:
                        agent.send({"t": protocol.PING})

    def _handle(self, kind: str, index: int, value: Any) -> None:
        if kind == "msg":
            self._on_message(self.agents[index], value)
        elif kind == "eof":
            self._on_agent_gone(self.agents[index], value)
        elif kind == "agent_err":
            output.note(f"host {self.agents[index].host}: {value}")
        elif kind == "hosts":
            self._on_hosts(value)
        elif kind == "discovery_error":
            log.warning("%s (keeping the last hosts)", value)
        elif kind == "signal":
            self._on_interrupt(value)

    # --- the elastic state machine ---------------------------------------------------------------------
    def _step(self, now: float) -> None:
        """One look at everything: stop leavers, read ready keys, start workers, publish, check deadlines."""
        for w in self.workers.values():
            if w.alive and w.leave_by is not None and now > w.leave_by:
                w.leave_by = None
                log.info("worker %s (%d) did not leave by itself: stopping it", w.wid, w.number)
                w.agent.send({"t": protocol.STOP, "grace": self.cfg.grace, "r": [w.number]})
        self._read_ready()
        if self._check_hopeless(now):
            return
        self._start_missing(now)
        self._publish_if_due(now)

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

    def _read_ready(self) -> None:
        for w in self.workers.values():
            if not w.alive or w.leaving:
                continue
            want = self.world.gen if self.world is not None and self._member(w) else None
            if w.ready is not None and (want is None or w.ready == want):
                continue  # nothing new can be in the key until the next world
            key = self._key(ep.READY, worker_id=w.wid)
            try:
                if self.store.check([key]):
                    w.ready = int(self.store.get(key).decode())
            except Exception as exc:  # our own store: fails only while shutting down
                log.debug("cannot read %s: %s", key, exc)

    def _slots_wanted(self, now: float) -> list[tuple[str, int]]:
        """``(host, slot)`` of every slot that should hold a worker now, capped at --max-np (slots of
        running workers counted first, so a cap never evicts a running worker)."""
        slots = [(h.name, s) for h in self.hostman.available(now) for s in range(h.slots)]
        cap = self.ecfg.max_np
        if cap is None or len(slots) <= cap:
            return slots
        running = {(w.host, ep.parse_worker_id(w.wid)[1]) for w in self.workers.values() if w.alive and not w.leaving}
        return ([s for s in slots if s in running] + [s for s in slots if s not in running])[:cap]

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
        base = self._members() + [w for w in self.workers.values() if w.alive and not w.leaving
                                  and not self._member(w)]
        plan = ep.assign_world(self._previous(base), (self.world.gen if self.world else 0) + 1,
                               [(w.wid, w.host) for w in base] + [(ep.worker_id(h, s), h) for h, s in missing])
        for host, host_slots in by_host.items():
            self._start_agent(host, host_slots, plan)

    def _start_agent(self, host: str, slots: list[int], plan: ep.World) -> None:
        """One agent on ``host`` for the workers of ``slots``; their start values come from ``plan``."""
        spec_workers = []
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
            spec_workers.append({"rank": number, "env": env})
            placed.append((wid, number, info))
        spec = self._spec(host, spec_workers)
        is_local = HostSpec(host, 1).is_local
        try:
            proc = self.transport_for(host, is_local).start(host, agent_argv(self.cfg.python), self.cfg.cwd)
        except OSError as exc:
            raise SetupError(f"host {host}: cannot start its agent ({exc.strerror or exc}); "
                             "install openssh-client or check the Python path") from None
        agent = AgentHandle(len(self.agents), host, proc, [number for _, number, _ in placed])
        self.agents.append(agent)
        new = [Worker(wid, host, number, agent, RankState(info)) for wid, number, info in placed]
        for w in new:
            self.workers[w.number] = w
            if self.cfg.output_filename:
                self.console.open_logs(range(w.number, w.number + 1))
        agent.send(spec)
        threading.Thread(target=self._pump, args=(agent,), daemon=True).start()
        threading.Thread(target=self._pump_stderr, args=(agent,), daemon=True).start()
        log.info("host %s: starting workers %s", host, ", ".join(w.wid for w in new))

    def _spec(self, host: str, workers: list[dict[str, Any]]) -> dict[str, Any]:
        base = envvars.forwarded(hora_env.launcher_environ(), self.cfg.env)
        if self.cfg.network_interfaces:
            base.setdefault("GLOO_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
            base.setdefault("NCCL_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
        return {"t": "spec", "command": list(self.cfg.command), "cwd": self.cfg.cwd, "env": base,
                "unset": [*envvars.RANK_VARIABLES, ep.ELASTIC_ENV, ep.WORKER_ID_ENV], "workers": workers,
                "store_addr": self.addr, "heartbeat_timeout": self.cfg.heartbeat_timeout, "host": host,
                "progress_interval": 0.25 if self.console.live else 1.0}

    def _pump(self, agent: AgentHandle) -> None:
        for raw in agent.proc.stdout:
            message = protocol.decode(raw)
            if message is not None:
                self.events.put(("msg", agent.index, message))
        self.events.put(("eof", agent.index, agent.proc.wait()))

    def _pump_stderr(self, agent: AgentHandle) -> None:
        for raw in agent.proc.stderr:
            self.events.put(("agent_err", agent.index, raw.decode(errors="replace").rstrip("\n")))

    def _publish_if_due(self, now: float) -> None:
        if self.world is None:
            self._publish_first(now)
            return
        members = self._members()
        resetting = self._lost_member or any(w.ready == self.world.gen for w in members)
        newcomers = self._newcomers()
        if not resetting:
            fresh = [w for w in newcomers if not w.announced]
            # workers started together join together (one reset, not one per worker), unless some take longer
            # than --start-timeout to get ready
            starting = [w for w in self.workers.values() if w.alive and not w.leaving and w.ready is None
                        and now - w.started_at < self.cfg.start_timeout]
            if fresh and not starting:
                self._post_update(ep.Update(added=tuple(dict.fromkeys(w.host for w in fresh))))
                for w in fresh:
                    w.announced = True
            return
        if self._reset_since is None:
            self._reset_since = now
        if not members:
            self._fail(f"no worker of world {self.world.gen} is left to carry the training state "
                       f"(hosts {', '.join(self.world.hosts())} all failed or were removed); a new world must keep "
                       "at least one worker of the old one", self._last_failed())
            return
        late = [w for w in members if w.ready != self.world.gen]
        if late:
            if now - self._reset_since > self.ecfg.elastic_timeout:
                names = ", ".join(f"rank {self.world.rank_of(w.wid)} ({w.wid})" for w in late)
                self._fail(f"{names} did not reset within --elastic-timeout {self.ecfg.elastic_timeout:g}s "
                           "(stuck outside hvd.elastic.run's reset?)")
            return
        chosen = members + newcomers
        if self.ecfg.max_np is not None:
            chosen = chosen[:self.ecfg.max_np]
        if len(chosen) < self.ecfg.min_np:
            return  # more workers may come; _check_hopeless applies the elastic timeout
        if self.ecfg.reset_limit is not None and self.world.gen > self.ecfg.reset_limit:
            self._fail(f"more than --reset-limit {self.ecfg.reset_limit} resets: the job reset "
                       f"{self.world.gen} times", self._last_failed())
            return
        self._publish(chosen)

    def _publish_first(self, now: float) -> None:
        """World 1: every started worker once all posted ready; after --start-timeout, those that did (if
        they are --min-np or more: the late ones join at a later world)."""
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
        self._reset_since, self._lost_member = None, False
        if previous is not None:
            self.stats.resets += 1
        for w in chosen:
            w.announced = False
        leave_by = time.monotonic() + LEAVE_GRACE
        for w in self.workers.values():
            if w.alive and w.leaving and w.leave_by is None:
                w.leave_by = leave_by
        old = previous.worker_ids() if previous else []  # in rank order, so the line reads the same every time
        joined = [wid for wid in world.worker_ids() if wid not in old]
        left = [wid for wid in old if wid not in world.workers]
        what = f"world {gen}: {world.size} worker{'s' if world.size != 1 else ''} on {', '.join(world.hosts())}"
        if previous is not None:
            what += "".join([f"; joined: {', '.join(joined)}" if joined else "",
                             f"; left: {', '.join(left)}" if left else ""])
        note(what)

    def _post_update(self, update: ep.Update) -> None:
        n = self.updates + 1
        self.store.set(self._key(ep.UPDATE, n=n), update.to_json())
        self.updates = int(self.store.add(self._key(ep.UPDATES), 1))
        log.info("update %d: %s", n, update)

    # --- hosts -----------------------------------------------------------------------------------------
    def _on_hosts(self, found: tuple[HostSpec, ...]) -> None:
        old_slots = dict(self.hostman.hosts)
        added, removed = self.hostman.update(found)
        shrunk = [h.name for h in found if h.name in old_slots and h.slots < old_slots[h.name]]
        if added:
            note(f"hosts added: {', '.join(added)}")
        if removed:
            note(f"hosts removed: {', '.join(removed)}")
        gone = set(removed)
        leaving_members = []
        for w in self.workers.values():
            if not w.alive or w.leaving:
                continue
            host, slot = ep.parse_worker_id(w.wid)
            if host in gone or (host in shrunk and slot >= self.hostman.hosts[host]):
                self._let_go(w)
                if self._member(w):
                    leaving_members.append(w.host)
        if leaving_members and not self.finishing:
            self._post_update(ep.Update(removed=tuple(dict.fromkeys(leaving_members))))

    def _let_go(self, w: Worker) -> None:
        """No world will hold ``w`` again: it exits 0 when it sees the next world (or is stopped)."""
        w.leaving = True
        if not self._member(w):
            w.leave_by = time.monotonic()  # not a member: nothing to wait for
        else:
            self._lost_member = True

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
            self._short_since = None
            return False
        if self._short_since is None:
            self._short_since = now
            note(f"{have} slot{'s' if have != 1 else ''} available, fewer than the {need} of {flag}; waiting up "
                 f"to --elastic-timeout {self.ecfg.elastic_timeout:g}s for hosts")
        if now - self._short_since > self.ecfg.elastic_timeout:
            blacklisted = [n for n in self.hostman.hosts if self.hostman.is_blacklisted(n, now)]
            extra = f"; blacklisted: {', '.join(blacklisted)}" if blacklisted else ""
            self._fail(f"fewer than {need} slots ({flag}) for --elastic-timeout {self.ecfg.elastic_timeout:g}s: "
                       f"{have} available (hosts: {', '.join(self.hostman.hosts) or 'none'}{extra})", self._last)
            return True
        return False

    # --- agents and workers ----------------------------------------------------------------------------
    def _on_message(self, agent: AgentHandle, message: dict[str, Any]) -> None:
        kind = message["t"]
        if kind == protocol.OUT:
            self.console.worker_line(int(message["r"]), message["s"], message["l"], message.get("ts"),
                                     message.get("k", protocol.LINE))
        elif kind == protocol.EXIT:
            w = self.workers[int(message["r"])]
            state = w.state
            state.done, state.code, state.sig = True, message.get("code"), message.get("sig")
            state.stopped = bool(message.get("stopped"))
            state.exit_ts = float(message.get("ts") or time.time())
            self._on_exit(w)
        elif kind == protocol.STARTED:
            agent.started = True
        elif kind == protocol.DONE:
            agent.finished = True

    def _on_exit(self, w: Worker) -> None:
        state = w.state
        how = state.how or procs.describe_exit(state.code, state.sig)
        member = self._member(w)
        self._post_ended(w, how)
        if w.leaving and state.failed and not state.stopped and self._stop_deadline is None:
            self.console.release(w.number)  # a removed host's worker that crashed on its way out: no failure
            note(f"worker {w.wid} of removed host {w.host} ended: {how}")
        if not state.failed or state.stopped or w.leaving:
            self.console.rank_done(w.number)
            if member and not w.leaving and self._stop_deadline is None and not state.stopped:
                if not self.finishing:
                    log.info("worker %s returned: the job is finishing", w.wid)
                self.finishing = True  # training is over: stop whoever has not joined
                for other in self.workers.values():
                    if other.alive and not self._member(other):
                        other.agent.send({"t": protocol.STOP, "grace": self.cfg.grace, "r": [other.number]})
            elif member and self._stop_deadline is None and not self.finishing:
                self._lost_member = True
            return
        if self._stop_deadline is not None:
            self.console.rank_done(w.number, failed=True)
            return
        self.stats.failures.append(f"{w.wid}: {how}")
        rank = self.world.rank_of(w.wid) if member and self.world is not None else None
        who = f"worker {w.wid} (process [{w.number}]" + (f", rank {rank})" if rank is not None else ")")
        if self.finishing:
            self._fail(f"{who} on host {w.host}: {how} while the job was finishing", w)
            return
        self.console.release(w.number)  # its traceback, as it printed it: the job goes on
        self.console.rank_done(w.number)
        delay = self.hostman.blacklist(w.host, time.monotonic(), how)
        back = "for good" if delay == float("inf") else f"for {delay:.0f}s"
        note(f"{who} on host {w.host} failed: {how}; host {w.host} blacklisted {back}")
        if member:
            self._lost_member = True
        for other in self.workers.values():  # the failed host's other workers go too
            if other.alive and other.host == w.host and not other.leaving:
                self._let_go(other)
                self._post_ended(other, f"stopped: host {w.host} was blacklisted")
                other.agent.send({"t": protocol.STOP, "grace": self.cfg.grace, "r": [other.number]})
        self._last = w

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

    def _last_failed(self) -> Worker | None:
        return self._last

    def _on_agent_gone(self, agent: AgentHandle, code: int) -> None:
        agent.finished = True
        lost = [self.workers[n] for n in agent.ranks if self.workers[n].alive]
        if not lost:
            return
        remote = not HostSpec(agent.host, 1).is_local
        if remote and code == SSH_FAILED:
            how = (f"lost: host {agent.host} stopped answering (its ssh connection ended; the host went down, its "
                   "network link broke, or its hora agent was killed)")
        else:
            how = f"lost: the agent on host {agent.host} ended ({procs.describe_exit(*split_returncode(code))})"
        for w in lost:
            w.state.done, w.state.code, w.state.exit_ts, w.state.how = True, 1, time.time(), how
            w.state.stopped = self._stop_deadline is not None or w.leaving
            self._on_exit(w)

    # --- the end ---------------------------------------------------------------------------------------
    def _fail(self, summary: str, worker: Worker | None = None) -> None:
        if self.failure is not None or self._stop_deadline is not None:
            return
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

    def _on_interrupt(self, signum: int) -> None:
        running = sum(1 for w in self.workers.values() if w.alive)
        if self.interrupted is not None or self._stop_deadline is not None:
            self.interrupted = self.interrupted or signum
            output.note(f"interrupted again: killing the {running} worker(s) still running now (SIGKILL)")
            self._force_kill()
            return
        self.interrupted = signum
        output.note(f"interrupted ({procs.signal_name(signum)}): stopping {running} worker(s) "
                    f"(SIGTERM, SIGKILL after {self.cfg.grace:g}s; press Ctrl-C again to kill them now)")
        self._stop_all()

    def _stop_all(self) -> None:
        if self._stop_deadline is not None:
            return
        self._stop_deadline = time.monotonic() + self.cfg.grace + KILL_AFTER_GRACE
        for agent in self.agents:
            agent.send({"t": protocol.STOP, "grace": self.cfg.grace})

    def _force_kill(self) -> None:
        for agent in self.agents:
            agent.close_stdin()
        deadline = time.monotonic() + 3.0
        for agent in self.agents:
            try:
                agent.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                procs.signal_groups([agent.proc.pid], signal.SIGKILL)
        for w in self.workers.values():
            if w.alive:
                w.state.done, w.state.code, w.state.stopped = True, 1, True

    def _shutdown_agents(self) -> None:
        for agent in self.agents:
            agent.close_stdin()
        signals = self._signals
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(a.proc.poll() is None for a in self.agents):
            if self._signals != signals:
                break
            time.sleep(0.05)
        for agent in self.agents:
            if agent.proc.poll() is None:
                procs.signal_groups([agent.proc.pid], signal.SIGKILL)
                agent.proc.wait()

    def _exit_status(self) -> int:
        if self.failure is not None:
            output.note(f"job failed: {self.failure.summary}")
            return self.failure.code
        if self.interrupted is not None:
            status = 128 + self.interrupted
            output.note(f"stopped after {procs.signal_name(self.interrupted)}: no worker is running; "
                        f"exit code {status}")
            return status
        final = [w for w in self.workers.values() if self._member(w) and not w.leaving]
        bad = [w for w in final if w.state.failed]
        if bad:
            w = bad[0]
            output.note(f"job failed: worker {w.wid}: {procs.describe_exit(w.state.code, w.state.sig)}")
            return procs.exit_status(w.state.code, w.state.sig) or 1
        if self.stats.resets:
            note(f"done: {self.stats.resets} reset{'s' if self.stats.resets != 1 else ''}, "
                 f"{len(self.stats.failures)} failure{'s' if len(self.stats.failures) != 1 else ''}")
        return 0
