"""Who sends which ranks' payloads to whom in a negotiation round on the TCP mesh: the round's schedule.

A round gathers every rank's payload on every rank. Two shapes, chosen by the number of ranks n
(``HORA_MESH_FULL_UPTO``, :func:`schedule`):

- **full**: one step. Each rank sends its payload to each other rank and receives each other's: one round
  trip, but n-1 connections and 2(n-1) frames per rank per round.
- **doubling** (recursive doubling): with p the largest power of two <= n, the ranks below p pair up in
  log2(p) steps, the partner of step k being ``rank ^ 2**k``: each sends the payloads it holds so far and
  receives as many, so after step k it holds those of its aligned block of 2**(k+1) ranks. The n-p *extra*
  ranks (p and above) fold into a partner: extra ``p+i`` and rank i swap their payloads before the first
  step, and the extra receives everything else from rank i after the last. log2(p) (+1) connections and
  about 2 log2(p) frames per rank per round; log2(p) round trips (+1 for the extras).

Every step sends before it waits, so a round that one rank starts wakes its idle peers step by step (an
idle negotiator wakes on a peer's frame); the swap is what wakes an idle extra.

Which ranks' payloads a frame holds (its *origins*, in rank order) follows from the schedule alone: a frame
names no ranks, and a receiver knows in advance what each frame of each peer must hold. Every connection
carries the same frames each round (one each way, and a second to an extra).

Example:
    >>> s = doubling(2, 6)  # p = 4: ranks 4 and 5 are extras, folded into ranks 0 and 1
    >>> s.peers
    (0, 3)
    >>> [(t.peer, t.origins) for step in s.steps for t in step.receives]
    [(3, (3,)), (0, (0, 1, 4, 5))]
    >>> [(t.peer, t.origins) for step in doubling(5, 6).steps for t in step.receives]
    [(1, (1,)), (1, (0, 2, 3, 4))]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FULL, DOUBLING = "full", "doubling"


@dataclass(frozen=True)
class Transfer:
    """One frame of a round: to or from ``peer``, holding the payloads of ``origins`` in this order."""

    peer: int
    origins: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    """Frames a rank sends, then frames it must receive before its next step (sends need not have left)."""

    sends: tuple[Transfer, ...] = ()
    receives: tuple[Transfer, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """One rank's part of a round: its steps, in order. The same every round."""

    rank: int
    size: int
    shape: str
    steps: tuple[Step, ...]

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this rank exchanges frames with (the only ones it connects to), in rank order."""
        return tuple(sorted({t.peer for step in self.steps for t in (*step.sends, *step.receives)}))

    def receiving(self) -> dict[int, list[Transfer]]:
        """The frames each peer sends this rank in a round, in order."""
        return _by_peer(t for step in self.steps for t in step.receives)

    def sending(self) -> dict[int, list[Transfer]]:
        """The frames this rank sends each peer in a round, in order."""
        return _by_peer(t for step in self.steps for t in step.sends)


def _by_peer(transfers: Iterable[Transfer]) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(t.peer, []).append(t)
    return out


def full(rank: int, size: int) -> Schedule:
    others = [r for r in range(size) if r != rank]
    step = Step(sends=tuple(Transfer(r, (rank,)) for r in others), receives=tuple(Transfer(r, (r,)) for r in others))
    return Schedule(rank, size, FULL, (step,) if others else ())


def doubling(rank: int, size: int) -> Schedule:
    p = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    extras = size - p
    everyone = tuple(range(size))
    if rank >= p:  # an extra: it swaps payloads with its partner, then gets everything else from it
        home = rank - p
        rest = tuple(r for r in everyone if r not in (rank, home))
        swap = Step(sends=(Transfer(home, (rank,)),), receives=(Transfer(home, (home,)),))
        return Schedule(rank, size, DOUBLING, (swap, Step(receives=(Transfer(home, rest),))))

    def block(first: int, width: int) -> tuple[int, ...]:
        """The payloads core ranks first..first+width-1 hold together: theirs and their extras'."""
        cores = range(first, first + width)
        return tuple(sorted([*cores, *(c + p for c in cores if c < extras)]))

    steps: list[Step] = []
    if rank < extras:  # sending first wakes the extra, which an idle rank needs to join the round
        steps.append(Step(sends=(Transfer(rank + p, (rank,)),), receives=(Transfer(rank + p, (rank + p,)),)))
    width = 1
    while width < p:
        partner = rank ^ width
        steps.append(Step(sends=(Transfer(partner, block(rank & ~(width - 1), width)),),
                          receives=(Transfer(partner, block(partner & ~(width - 1), width)),)))
        width <<= 1
    if rank < extras:
        steps.append(Step(sends=(Transfer(rank + p, tuple(r for r in everyone if r not in (rank, rank + p))),)))
    return Schedule(rank, size, DOUBLING, tuple(steps))


def schedule(rank: int, size: int, full_upto: int) -> Schedule:
    """The full exchange up to ``full_upto`` ranks, recursive doubling above."""
    return full(rank, size) if size <= full_upto else doubling(rank, size)
