"""The driver's side of the board shared with the ranks (keys in :mod:`hora.protocol.messages`).

Ranks whose negotiation round waits for peers that do not answer post whom they wait for. A rank that posts
nothing while others wait for it cannot run Python (stopped, in a native call holding the GIL): its agent is
asked what ``/proc`` says about its process. Two groups of ranks that wait for each other in the same round
(or one round apart: one side finished a round whose last frame the other never got) are cut off from each
other by the network (the launcher still reaches both). Each finding is one
``hora run: stall: ...`` line, and the root-cause headline later names that rank or host rather than a rank
that only waited. The driver also posts every rank's exit, so ranks waiting for one that has exited (its
connections held open by a process it forked) stop waiting at once.

Ranks whose data transfers (a large allreduce on the wire) have not finished past the stall warning time post
those too: the members of the transfer's process set that posted nothing froze in the middle of it (its
agent says how). Those ranks cannot end the transfer (a c10d wait cannot be interrupted): once one posts that
the stall shutdown time has passed, :meth:`StallWatch.shutdown_due` names the frozen rank and the driver ends
the job with it as the root cause.

Example:
    >>> watch = StallWatch(None, "", {0: "a", 1: "b"})
    >>> watch.analyse({0: {"missing": [1], "round": 7, "waited": 2.0}})
    ([1], [])
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hora.errors import StoreAuthError
from hora.protocol import messages as protocol
from hora.protocol import signedstore

log = logging.getLogger(__name__)

SETTLE_S = 1.5  # after a first post, wait this long for the others' (every waiting rank posts within a second)
PROBE_WAIT_S = 3.0  # at the shutdown time, wait at most this long for the agents' answers about frozen ranks


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"


@dataclass
class Finding:
    """A culprit the driver found: the rank (or, for a partition, a rank on the far host) and how."""

    rank: int
    how: str


@dataclass
class Held:
    """A data transfer that ranks posted as not finished: what it is and who waits for it."""

    op: str  # in words: "allreduce 'big'"
    nbytes: int
    waiting: list[int]  # the ranks that posted it
    waited: float  # the longest any of them has waited

    def describe(self) -> str:
        return f"{self.op} ({_bytes(self.nbytes)})"


def _adjacent(post: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Two waiting posts are of the same negotiation round or of consecutive ones."""
    try:
        return abs(int(post.get("round", -9)) - int(other.get("round", 9))) <= 1
    except (TypeError, ValueError):
        return False


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass
class StallWatch:
    """See the module docstring. ``store`` is the driver's :class:`~hora.protocol.signedstore.SignedStore` (None:
        nothing to
    read; a post that fails its MAC check is ignored, with one warning per key), ``hosts`` maps each rank to its
    host."""

    store: Any
    job_id: str
    hosts: Mapping[int, str]
    _seen: int = 0
    _due: float | None = None
    _probed: set[int] = field(default_factory=set)
    _pairs: set[tuple[str, str]] = field(default_factory=set)
    waited: dict[int, float] = field(default_factory=dict)
    findings: dict[int, Finding] = field(default_factory=dict)
    partition: Finding | None = None
    held: dict[int, Held] = field(default_factory=dict)  # rank -> the transfer it holds up (its peers' posts)
    _expired: tuple[float, Held | None, float] | None = None  # since when, the transfer, its shutdown time

    def _key(self, key: str, **fields: object) -> str:
        return protocol.board_key(self.job_id, key, **fields)

    def rank_ended(self, rank: int, how: str) -> None:
        """Post that ``rank`` has exited (ranks still waiting for it give up at once)."""
        if self.store is None:
            return
        try:
            self.store.set(self._key(protocol.ENDED, rank=rank), how)
            self.store.add(self._key(protocol.ENDS), 1)
        except Exception as e:  # the store is the driver's own: this only fails while it shuts down
            log.debug("board: cannot post the exit of rank %d: %s", rank, e)

    def poll(self, now_or_never: bool = False) -> tuple[list[int], list[str]]:
        """Called every tick: the ranks to probe and the lines to print (nothing most of the time).

        ``now_or_never``: read whatever was posted without waiting for the settle time (the driver is about to
        name a failure's root cause: a partition whose posts are still settling must be found now, whichever
        rank's stall shutdown ended first)."""
        if self.store is None:
            return [], []
        try:
            count = int(self.store.add(self._key(protocol.WAITS), 0))
        except Exception:
            return [], []
        now = time.monotonic()
        if count != self._seen:
            self._seen = count
            if self._due is None:  # counted from the first post of a burst: ranks that keep posting (a
                self._due = now + SETTLE_S  # transfer past the shutdown time) do not hold the report back
        if self._due is None or (now < self._due and not now_or_never):
            return [], []
        self._due = None
        return self.analyse(self._read(protocol.WAITING), self._read(protocol.INFLIGHT))

    def _read(self, key_format: str) -> dict[int, dict[str, Any]]:
        found = {}
        for rank in self.hosts:
            key = self._key(key_format, rank=rank)
            try:
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
            except StoreAuthError as e:  # a stranger's post: the stall report goes on without it
                signedstore.ignored(e)
            except Exception:
                continue
        return found

    def analyse(self, waiting: Mapping[int, Mapping[str, Any]],
                inflight: Mapping[int, Mapping[str, Any]] | None = None) -> tuple[list[int], list[str]]:
        """From the ranks' posts (negotiation rounds that wait, data transfers that have not finished): the silent
        ranks not probed yet, and the partition lines not printed yet."""
        notes = []
        frozen = self._transfers(waiting, inflight or {})
        for post in waiting.values():
            for peer in post.get("missing", []):
                self.waited[peer] = max(self.waited.get(peer, 0.0), float(post.get("waited", 0.0)))
        silent = sorted({p for post in waiting.values() for p in post.get("missing", []) if p not in waiting})
        # ranks that wait for each other: the link between their hosts is cut. They are in the same round, or one
        # round apart: a rank that got its peer's frame of a round finished it and waits in the next, while the
        # peer still waits for the frame that rank sent in the finished round (lost on the cut link)
        cut: dict[tuple[str, str], tuple[set[int], set[int]]] = {}
        for rank, post in waiting.items():
            for peer in post.get("missing", []):
                other = waiting.get(peer)
                if other is None or rank not in other.get("missing", []) or not _adjacent(post, other):
                    continue
                a, b = sorted((rank, peer))
                pair = (self.hosts[a], self.hosts[b])
                if pair[0] == pair[1]:
                    continue
                sides = cut.setdefault(pair, (set(), set()))
                sides[0].add(a)
                sides[1].add(b)
        for (host_a, host_b), (side_a, side_b) in sorted(cut.items()):
            if (host_a, host_b) in self._pairs:
                continue
            self._pairs.add((host_a, host_b))
            how = (f"unreachable from host {host_a}: {_ranks(sorted(side_a))} on {host_a} and {_ranks(sorted(side_b))} "
                   f"on {host_b} wait for each other in negotiation and all are running: the network "
                   f"between hosts {host_a} and {host_b} is cut (hora run still reaches both)")
            if self.partition is None:
                self.partition = Finding(min(side_b), how)
            notes.append(f"stall: hosts {host_a} and {host_b} cannot reach each other: {_ranks(sorted(side_a))} on "
                         f"{host_a} and {_ranks(sorted(side_b))} on {host_b} wait for each other and all are running "
                         "(a network partition; hora run still reaches both hosts)")
        fresh = [r for r in sorted(set(silent) | frozen) if r not in self._probed]
        self._probed.update(fresh)
        return fresh, notes

    def _transfers(self, waiting: Mapping[int, Mapping[str, Any]], inflight: Mapping[int, Mapping[str, Any]]
                   ) -> set[int]:
        """The members of posted transfers that posted nothing themselves (frozen mid-transfer); notes whether a
        transfer is past the shutdown time. All posts withdrawn: forget them (a later freeze is new)."""
        posts = {r: p for r, p in inflight.items() if p.get("ops")}
        if not posts:
            for rank in self.held:
                self._probed.discard(rank)
            self.held.clear()
            self._expired = None
            return set()
        alive = set(waiting) | set(posts)
        frozen: set[int] = set()
        first: Held | None = None
        for rank, post in sorted(posts.items()):
            for op in post["ops"]:
                members = [int(m) for m in op.get("ps", [])]
                for peer in members:
                    if peer in alive:
                        continue
                    held = self.held.setdefault(peer, Held(str(op.get("op", "a transfer")), int(op.get("bytes", 0)),
                                                           [], 0.0))
                    if rank not in held.waiting:
                        held.waiting.append(rank)
                    held.waited = max(held.waited, float(op.get("age", 0.0)))
                    self.waited[peer] = max(self.waited.get(peer, 0.0), held.waited)
                    frozen.add(peer)
                    first = first or held
        expired = [p for p in posts.values() if p.get("expired")]
        if expired and self._expired is None:
            shutdown = max(float(p.get("shutdown", 0.0)) for p in expired)
            if first is None:  # every member posted: all of them are alive and wait for each other
                op = expired[0]["ops"][0]
                first = Held(str(op.get("op", "a transfer")), int(op.get("bytes", 0)), sorted(posts), 0.0)
            self._expired = (time.monotonic(), first, shutdown)
        return frozen

    def shutdown_due(self, action: str = "hora run stopped the job") -> Finding | None:
        """Once a posted transfer is past the stall shutdown time: the root cause to end the job with (the frozen
        rank, with what its agent saw; its answer is awaited for up to :data:`PROBE_WAIT_S`), else None.
        ``action``: what the driver does about it, the finding's last words."""
        if self._expired is None:
            return None
        since, held, shutdown = self._expired
        frozen = sorted(self.held)
        if any(r not in self.findings for r in frozen) and time.monotonic() - since < PROBE_WAIT_S:
            return None
        self._expired = None
        deadline = f"--stall-check-shutdown-time-seconds {shutdown:g}"
        if held is None:
            return None
        if not frozen:
            hosts = sorted({self.hosts.get(r, "?") for r in held.waiting})
            return Finding(min(held.waiting), (
                f"{held.describe()} did not finish within {deadline} s, and every member ({_ranks(held.waiting)}) "
                f"waits for it in the communication backend and is running: the network between hosts "
                f"{', '.join(hosts)} is slow or cut; {action}"))
        rank = frozen[0]
        held, seen = self.held[rank], self.findings.get(rank)
        return Finding(rank, (
            f"did not finish {held.describe()} within {deadline} s while {_ranks(sorted(held.waiting))} waited for "
            f"it in the communication backend: {seen.how if seen else 'its agent did not answer'}; {action}"))

    def on_probe(self, rank: int, how: str) -> str:
        """An agent's answer about a silent rank: remember it, and the line to print."""
        waited = self.waited.get(rank, 0.0)
        self.findings[rank] = Finding(rank, how)
        host = self.hosts.get(rank, "?")
        held = self.held.get(rank)
        if held is not None:
            return (f"stall: rank {rank} on host {host} has not finished {held.describe()}, which "
                    f"{_ranks(sorted(held.waiting))} {'has' if len(held.waiting) == 1 else 'have'} waited {waited:.0f} "
                    f"s for in the communication backend: {how}")
        return f"stall: rank {rank} on host {host} has not answered its peers for {waited:.0f} s: {how}"

    def culprit(self) -> Finding | None:
        """The rank a waiting rank named as the culprit of its failure (with what its agent saw), a partition
        the driver found, else None."""
        if self.partition is not None:
            return self.partition
        named = self._named()
        if named is None:
            return None
        seen = self.findings.get(named.rank)
        return Finding(named.rank, f"{named.how}: {seen.how}" if seen else named.how)

    def _named(self) -> Finding | None:
        if self.store is None:
            return None
        key = self._key(protocol.CULPRIT)
        try:
            if not self.store.check([key]):
                return None
            value = json.loads(self.store.get(key))
            return Finding(int(value["rank"]), str(value["how"]))
        except StoreAuthError as e:  # a stranger named a culprit: none is known
            signedstore.ignored(e)
            return None
        except Exception:
            return None
