"""The driver's side of the board shared with the ranks (keys in :mod:`hora.launch.protocol`).

Ranks whose negotiation round waits for peers that do not answer post whom they wait for. A rank that posts
nothing while others wait for it cannot run Python (stopped, in a native call holding the GIL): its agent is
asked what ``/proc`` says about its process. Two groups of ranks that wait for each other in the same round
are cut off from each other by the network (the launcher still reaches both). Each finding is one
``hora run: stall: ...`` line, and the root-cause headline later names that rank or host rather than a rank
that only waited. The driver also posts every rank's exit, so ranks waiting for one that has exited (its
connections held open by a process it forked) stop waiting at once.

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

from hora.launch import protocol

log = logging.getLogger(__name__)

SETTLE_S = 1.5  # after a post, wait this long for the others' (every waiting rank posts within a second)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"


@dataclass
class Finding:
    """A culprit the driver found: the rank (or, for a partition, a rank on the far host) and how."""

    rank: int
    how: str


@dataclass
class StallWatch:
    """See the module docstring. ``store`` is the driver's store (None: nothing to read), ``hosts`` maps each
    rank to its host."""

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

    def poll(self) -> tuple[list[int], list[str]]:
        """Called every tick: the ranks to probe and the lines to print (nothing most of the time)."""
        if self.store is None:
            return [], []
        try:
            count = int(self.store.add(self._key(protocol.WAITS), 0))
        except Exception:
            return [], []
        now = time.monotonic()
        if count != self._seen:
            self._seen = count
            self._due = now + SETTLE_S
        if self._due is None or now < self._due:
            return [], []
        self._due = None
        return self.analyse(self._read_waiting())

    def _read_waiting(self) -> dict[int, dict[str, Any]]:
        found = {}
        for rank in self.hosts:
            key = self._key(protocol.WAITING, rank=rank)
            try:
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
            except Exception:
                continue
        return found

    def analyse(self, waiting: Mapping[int, Mapping[str, Any]]) -> tuple[list[int], list[str]]:
        """From the ranks' posts: the silent ranks not probed yet, and the partition lines not printed yet."""
        notes = []
        for post in waiting.values():
            for peer in post.get("missing", []):
                self.waited[peer] = max(self.waited.get(peer, 0.0), float(post.get("waited", 0.0)))
        silent = sorted({p for post in waiting.values() for p in post.get("missing", []) if p not in waiting})
        # ranks in the same round that wait for each other: the link between their hosts is cut
        cut: dict[tuple[str, str], tuple[set[int], set[int]]] = {}
        for rank, post in waiting.items():
            for peer in post.get("missing", []):
                other = waiting.get(peer)
                if other is None or other.get("round") != post.get("round") or rank not in other.get("missing", []):
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
                   f"on {host_b} wait for each other in the same negotiation round and all are running: the network "
                   f"between hosts {host_a} and {host_b} is cut (hora run still reaches both)")
            if self.partition is None:
                self.partition = Finding(min(side_b), how)
            notes.append(f"stall: hosts {host_a} and {host_b} cannot reach each other: {_ranks(sorted(side_a))} on "
                         f"{host_a} and {_ranks(sorted(side_b))} on {host_b} wait for each other and all are running "
                         "(a network partition; hora run still reaches both hosts)")
        fresh = [r for r in silent if r not in self._probed]
        self._probed.update(fresh)
        return fresh, notes

    def on_probe(self, rank: int, how: str) -> str:
        """An agent's answer about a silent rank: remember it, and the line to print."""
        waited = self.waited.get(rank, 0.0)
        self.findings[rank] = Finding(rank, how)
        host = self.hosts.get(rank, "?")
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
        except Exception:
            return None
