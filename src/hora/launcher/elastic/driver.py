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

Output lines carry each worker process's number (the first world's processes are numbered like its ranks;
later ones get the next numbers), so a process's lines and log files (``--output-filename``) keep one name
for its whole life while its rank changes.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import uuid
from typing import Any

from hora.common import env as hora_env
from hora.errors import SetupError
from hora.launcher import envvars, output, procs
from hora.launcher.elastic.driver_state import Worker, note
from hora.launcher.elastic.hosts import DISCOVERY_INTERVAL, Discovery, DiscoveryError
from hora.launcher.elastic.worlds import ElasticWorlds
from hora.launcher.failures import RankState
from hora.launcher.hosts import HostSpec, SlotInfo
from hora.launcher.output_lock import OutputLock, lock_paths
from hora.launcher.remote.agent_handle import PING_INTERVAL, AgentHandle, split_returncode, start_pumps
from hora.launcher.remote.transport import SSH_FAILED, agent_argv
from hora.protocol import elastic as ep
from hora.protocol import messages as protocol

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between two looks at the store (ready keys) when nothing else happens
# ... while nothing is under way (every worker trains in the newest world, no update or loss pending): as the
# fixed driver's. A look costs two store round trips per worker, and in a job whose workers fill every core
# the launcher's CPU comes out of their steps (about 2.5 % of a core at TICK with 4 workers, measured).
# Events (a worker's exit, discovery, output) still wake the loop at once; only a reset nobody announced
# (a stall shutdown, a broken link) is seen up to this much later.
STEADY_TICK = 0.5


class ElasticDriver(ElasticWorlds):
    """Runs an elastic job: see the module docstring. The state and the job's end are in
    :mod:`hora.launcher.elastic.driver_state`, the worlds' bookkeeping in :mod:`hora.launcher.elastic.worlds`.

    Args:
        cfg: the checked job (``cfg.elastic`` set).
        transport_for: ``(host, is_local) -> Transport``; tests pass their own.
        store_ready: called with the rendezvous store before any worker starts (``hora.run`` ships its
            function through it).
    """

    # --- running ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the job to the end; return the exit status for the ``hora run`` process."""
        self.job_id = uuid.uuid4().hex[:12]
        outputs = OutputLock.hold(lock_paths(self.cfg.output_filename, self.cfg.timeline_filename), self.job_id)
        previous = {}
        try:
            hosts = self._first_hosts()
            self._start_store(hosts)
            if threading.current_thread() is threading.main_thread():
                previous = {s: signal.signal(s, self._on_signal) for s in procs.stop_signals()}
            try:
                self._loop()
            finally:
                self._stopping.set()
                if self.discovery is not None:
                    self.discovery.stop()
                self._shutdown_agents()
                self.console.close()
            return self._exit_status()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            outputs.release()

    def _first_hosts(self) -> list[HostSpec]:
        """The hosts known before the store starts (it must listen on an address they reach)."""
        if self.ecfg.discovery_script is None:
            self.hostman.update(self.cfg.hosts)
            return list(self.cfg.hosts)
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
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                self.events.put(("hosts", -1, self.discovery.run()))
            except DiscoveryError as exc:
                self.events.put(("discovery_error", -1, str(exc)))
            self._stopping.wait(max(0.0, DISCOVERY_INTERVAL - (time.monotonic() - began)))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.events.put(("signal", -1, signum))

    def _loop(self) -> None:
        last_ping = time.monotonic()
        self._start_deadline = time.monotonic() + self.cfg.start_timeout
        self._short_since = time.monotonic()
        while True:
            try:
                kind, index, value = self.events.get(timeout=STEADY_TICK if self._steady() else TICK)
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

    def _step(self, now: float) -> None:
        """One look at everything: stop leavers, read ready keys, start workers, publish, check deadlines."""
        for w in self.workers.values():
            if w.alive and w.leave_by is not None and now > w.leave_by:
                w.leave_by = None
                log.info("worker %s (%d) did not leave by itself: stopping it", w.wid, w.number)
                w.agent.send({"t": protocol.STOP, "grace": self.cfg.grace, "r": [w.number]})
        self._read_ready()
        self._watch_stalls()
        if self._check_hopeless(now):
            return
        self._start_missing(now)
        self._publish_if_due(now)

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
                self.console.open_logs(range(w.number, w.number + 1), strict=False)
        agent.send(spec)
        start_pumps(agent, self.events)
        log.info("host %s: starting workers %s", host, ", ".join(w.wid for w in new))

    def _spec(self, host: str, workers: list[dict[str, Any]]) -> dict[str, Any]:
        base = envvars.forwarded(hora_env.launcher_environ(), self.cfg.env)
        if self.cfg.network_interfaces:
            base.setdefault("GLOO_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
            base.setdefault("NCCL_SOCKET_IFNAME", ",".join(self.cfg.network_interfaces))
        return {"t": "spec", "command": list(self.cfg.command), "cwd": self.cfg.cwd, "env": base,
                "unset": [*envvars.RANK_VARIABLES, ep.ELASTIC_ENV, ep.WORKER_ID_ENV], "workers": workers,
                "store_addr": self.addr, "secret": self.secret.hex(), "heartbeat_timeout": self.cfg.heartbeat_timeout,
                "host": host, "progress_interval": 0.25 if self.console.live else 1.0}

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
            state.killed = float(message.get("killed") or 0.0)
            if message.get("oom"):  # the agent found the kernel's OOM killer behind the SIGKILL
                state.how = f"{message['oom']}, {procs.describe_exit(state.code, state.sig)}"
            state.exit_ts = float(message.get("ts") or time.time())
            if w.stalled and self._stop_deadline is None:  # the stall inspector's stop: a failure
                state.stopped, state.how = False, w.stalled
            self._on_exit(w)
        elif kind == protocol.STARTED:
            agent.started = True
        elif kind == protocol.DONE:
            agent.finished = True
        elif kind == protocol.PROBE and self._stop_deadline is None and self.world is not None:
            w = self.workers[int(message["r"])]
            rank = self.world.rank_of(w.wid) if self._member(w) else None
            if rank is not None:
                output.note(self.stalls.on_probe(rank, str(message.get("how", ""))))

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
            self._lost_member = True
        self._last = w

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
    def _on_interrupt(self, signum: int) -> None:
        running = sum(1 for w in self.workers.values() if w.alive)
        if self.interrupted is not None or self._stop_deadline is not None:
            self.interrupted = self.interrupted or signum
            output.note(f"interrupted again: killing the {running} worker(s) still running now (SIGKILL)")
            self._force_kill()
            return
        self.interrupted = signum
        again = "; press Ctrl-C again to kill them now" if signum == signal.SIGINT else ""
        output.note(f"interrupted ({procs.stop_reason(signum)}): stopping {running} worker(s) "
                    f"(SIGTERM, SIGKILL after {self.cfg.grace:g}s{again})")
        self._stop_all()

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
        killed = [w for w in self.workers.values() if w.state.killed]
        if killed:
            output.note(output.grace_ran_out([f"worker {w.wid} (process [{w.number}]) on host {w.host}"
                                              for w in killed], max(w.state.killed for w in killed)))
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
