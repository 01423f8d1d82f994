"""Moving named optimizer-state entries between the members of a process set (a sharded optimizer's state).

An *entry* is one parameter's optimizer state (``{"exp_avg": tensor, "step": tensor, ...}``) under the
parameter's name. :func:`exchange` gives every member the entries it asks for, each from one member that holds
it; :func:`shift` gives every member the entries of the member before it (the elastic commit's copy of a
neighbour's shard). Both are collectives: every member calls them at the same point.

Entries travel point to point (one ``alltoall`` of bytes, each member receiving only what it asked for, so no
rank ever holds more than its own entries plus what it receives), serialized with ``torch.save`` and read back
with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers of them, never code. Entries
a member holds itself and asks for are not serialized at all.

Example:
    >>> got = exchange({"fc.weight": {"step": 3}}, want=["fc.bias"], name="x")  # doctest: +SKIP
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hora.api import functions, ops
from hora.common.process_sets import ProcessSet, global_process_set

Entries = dict[str, Any]


@dataclass(frozen=True)
class Offer:
    """What one member says before an exchange: the names it holds live, the names it holds as a spare copy,
    the names it wants, and ``extra`` (anything small the caller wants every member to see)."""

    held: tuple[str, ...]
    spare: tuple[str, ...]
    want: tuple[str, ...]
    extra: Any = None


def _dumps(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def _loads(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True)


def _alltoall(payloads: list[Entries], name: str, process_set: ProcessSet) -> list[Entries]:
    """Member ``i``'s ``payloads[j]`` arrives as member ``j``'s result ``[i]`` (empty dicts cost nothing)."""
    parts = [_dumps(p) if p else torch.empty(0, dtype=torch.uint8) for p in payloads]
    send = torch.cat(parts) if any(t.numel() for t in parts) else torch.empty(0, dtype=torch.uint8)
    splits = torch.tensor([t.numel() for t in parts], dtype=torch.int32)
    received, got = ops.alltoall(send, splits=splits, name=name, process_set=process_set)
    out, offset = [], 0
    for n in got.tolist():
        out.append(_loads(received[offset:offset + n]) if n else {})
        offset += n
    return out


def exchange(held: Mapping[str, Any], want: Iterable[str], *, name: str, spare: Mapping[str, Any] | None = None,
             extra: Any = None, process_set: ProcessSet = global_process_set) -> tuple[Entries, list[Offer]]:
    """Give every member the entries it wants.

    Each wanted name comes from the lowest member that holds it live (``held``); where none does, from the
    lowest that holds a spare copy (``spare``). Names nobody holds are left out of the result.

    Args:
        held: this member's live entries.
        want: the names this member wants.
        name: the collectives' name prefix (the same on every member).
        spare: this member's spare copies (entries of other members, kept in case they leave).
        extra: a small picklable value shown to every member in the returned offers.
        process_set: the members.

    Returns:
        (the wanted entries found, every member's :class:`Offer` in member order).
    """
    spare = spare or {}
    mine = Offer(tuple(sorted(held)), tuple(sorted(spare)), tuple(sorted(set(want))), extra)
    # plain tuples on the wire (no class of ours to unpickle)
    gathered = functions.allgather_object((mine.held, mine.spare, mine.want, extra), name=f"{name}.offers",
                                          process_set=process_set)
    offers = [Offer(*fields) for fields in gathered]
    me = process_set.rank()
    live: dict[str, int] = {}
    backup: dict[str, int] = {}
    for member, offer in enumerate(offers):
        for key in offer.held:
            live.setdefault(key, member)
        for key in offer.spare:
            backup.setdefault(key, member)
    payloads: list[Entries] = [{} for _ in offers]
    for member, offer in enumerate(offers):
        for key in offer.want:
            source, table = (live[key], held) if key in live else (backup.get(key, -1), spare)
            if source == me and member != me:
                payloads[member][key] = table[key]
    result: Entries = {}
    for key in mine.want:  # what this member already has is not sent
        if live.get(key) == me:
            result[key] = held[key]
        elif key not in live and backup.get(key) == me:
            result[key] = spare[key]
    if any(payloads) or _anyone_sends(offers, live, backup):
        for received in _alltoall(payloads, f"{name}.entries", process_set):
            result.update(received)
    return result, offers


def _anyone_sends(offers: list[Offer], live: Mapping[str, int], backup: Mapping[str, int]) -> bool:
    """Whether some member sends some other member an entry (every member computes the same answer, so all
    of them skip the alltoall together when nothing moves)."""
    for member, offer in enumerate(offers):
        for key in offer.want:
            source = live.get(key, backup.get(key, member))
            if source != member:
                return True
    return False


def shift(entries: Entries, *, name: str, process_set: ProcessSet = global_process_set) -> Entries:
    """Send ``entries`` to the next member (the last to the first); return the previous member's."""
    size = process_set.size()
    if size == 1:
        return {}
    payloads: list[Entries] = [{} for _ in range(size)]
    payloads[(process_set.rank() + 1) % size] = entries
    received = _alltoall(payloads, name, process_set)
    return received[(process_set.rank() - 1) % size]
