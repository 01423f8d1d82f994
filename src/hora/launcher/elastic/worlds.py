"""The elastic driver's rendezvous bookkeeping: the store, the workers' ready keys, the slots and hosts a world
may use, and when and which world to publish (the contract of :mod:`hora.protocol.elastic`)."""

from __future__ import annotations

import logging
import time

from hora.errors import StoreAuthError
from hora.launcher import store
from hora.launcher.elastic.driver_state import LIMIT_EXIT, ElasticState, Worker, note
from hora.launcher.hosts import HostSpec
from hora.launcher.stall_watch import StallWatch
from hora.protocol import elastic as ep
from hora.protocol import network
from hora.protocol.signedstore import SignedStore

log = logging.getLogger(__name__)

LEAVE_GRACE = 10.0  # a removed worker that has not exited this long after the world without it is stopped


class ElasticWorlds(ElasticState):
    """Publishes the worlds of an elastic job (the driver loop in :class:`hora.launcher.elastic.driver.ElasticDriver`
    calls it)."""

    # --- the rendezvous store --------------------------------------------------------------------------
    def _start_store(self, hosts: list[HostSpec]) -> None:
        remote = [h.name for h in hosts if not h.is_local]
        self.addr = network.store_address(remote, self.cfg.network_interfaces)
        raw = store.listen(self.addr, max(self.cfg.start_timeout, 60))  # on the job's address only
        self.port = int(raw.port)
        self.store = SignedStore(raw, self.secret, self.job_id, f"{self.addr}:{self.port}")
        if self.store_ready is not None:
            self.store_ready(self.store)
        log.info("rendezvous store on %s:%d (job %s)", self.addr, self.port, self.job_id)

    def _read_ready(self) -> None:
        for w in self.workers.values():
            if not w.alive or (w.leaving and not self._member(w)):  # a removed member may hand the state over
                continue
            want = self.world.gen if self.world is not None and self._member(w) else None
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
        carriers = sorted({w.host for w in self._members()}) if not self.finishing else []
        others = [h for h in found if h.name not in carriers and not self.hostman.is_blacklisted(h.name, now)]
        if carriers and set(carriers) <= confirmed and not others:
            if self._unlisted_since is None:
                self._unlisted_since = now
                note(f"discovery lists none of the hosts of world {self.world.gen if self.world else 0}'s workers "
                     f"({', '.join(carriers)}), which hold the training state: they go on until discovery lists "
                     "their hosts again or other hosts can take the state over (up to --elastic-timeout "
                     f"{self.ecfg.elastic_timeout:g}s)")
            elif now - self._unlisted_since > self.ecfg.elastic_timeout:
                self._fail(f"discovery has listed none of the hosts of the workers that hold the training state "
                           f"({', '.join(carriers)}) and no other host for --elastic-timeout "
                           f"{self.ecfg.elastic_timeout:g}s; check the --host-discovery-script", code=LIMIT_EXIT)
            kept += [HostSpec(n, self.hostman.hosts[n]) for n in carriers]
        elif self._unlisted_since is not None:
            self._unlisted_since = None
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

    # --- publishing worlds -----------------------------------------------------------------------------
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
        carriers = [] if members else self._carriers()
        if not members and not carriers:
            self._fail(f"no worker of world {self.world.gen} is left to carry the training state "
                       f"(hosts {', '.join(self.world.hosts())} all failed or were removed); a new world must keep "
                       "at least one worker of the old one", self._last_failed())
            return
        late = [w for w in members or carriers if w.ready != self.world.gen]
        if late:
            if now - self._reset_since > self.ecfg.elastic_timeout:
                names = ", ".join(f"rank {self.world.rank_of(w.wid)} ({w.wid})" for w in late)
                self._fail(f"{names} did not reset within --elastic-timeout {self.ecfg.elastic_timeout:g}s "
                           "(stuck outside hvd.elastic.run's reset?)")
            return
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
        last = self._last_failed()
        trigger = last if last is not None and last.state.exit_ts >= self._published_ts else None
        why = f"worker {trigger.wid} failed" if trigger is not None else "the hosts changed"
        self._fail(f"--reset-limit {limit} reached: the job has reset {done} time{'s' if done != 1 else ''} and "
                   f"{why}, which needs another reset; it stops here (exit code {LIMIT_EXIT})", trigger, LIMIT_EXIT)

    def _carriers(self) -> list[Worker]:
        """The live workers of the newest world on hosts that discovery removed (they leave gracefully)."""
        return [w for w in self.workers.values() if w.alive and w.leaving and self._member(w)]

    def _ready_to_take_over(self, now: float, carriers: list[Worker], newcomers: list[Worker]) -> bool:
        """Every member left is on a removed host: its workers hand the training state over before they leave.
        True once new workers are ready to take it (those started together, unless some take longer than
        --start-timeout); the job fails if none is within --elastic-timeout of the removal."""
        starting = [w for w in self.workers.values() if w.alive and not w.leaving and w.ready is None
                    and now - w.started_at < self.cfg.start_timeout]
        if newcomers and not starting:
            return True
        assert self._reset_since is not None
        if not self._handing_over:
            self._handing_over = True
            note(f"hosts {', '.join(dict.fromkeys(w.host for w in carriers))} removed: their workers hold the training "
                 f"state and wait for new workers to take it (up to --elastic-timeout {self.ecfg.elastic_timeout:g}s)")
        if now - self._reset_since > self.ecfg.elastic_timeout:
            self._fail(f"the workers of removed hosts ({', '.join(w.wid for w in carriers)}) hold the only copy of "
                       f"the training state and no new worker was ready to take it within --elastic-timeout "
                       f"{self.ecfg.elastic_timeout:g}s; add hosts sooner, or give a longer --elastic-timeout")
        return False

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
        self.stalls = StallWatch(self.store, ep.world_job_id(self.job_id, gen),
                                 {p.rank: p.hostname for p in world.workers.values()})
        self._reset_since, self._lost_member, self._handing_over = None, False, False
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
