"""A negotiation round's frame: what one rank tells every other rank in a round, as bytes and back, and the
response cache that shortens the requests in it.

The response cache (:class:`ResponseCache`): a request seen before with identical metadata travels as a small
integer. Every rank runs :meth:`ResponseCache.remember` on the same ready entries in the same order, so cache
ids agree everywhere without any extra message. A named op is cached as is; an unnamed op, whose sequence
name changes every call, is cached by *template* (its request without the name) and sent as ``(id, name)``.
In steady state a round of the optimizer's bucket allreduces carries a few bytes per rank.

A frame holds the rank's requests (each as a response-cache id, an id and a name, or the request in full),
the data of its tiny allreduces sent inline, and the round's flags (stall queries and answers, notices). The
steady state (cached requests, no flags) is a few fixed-size fields per op, packed with precompiled structs;
full requests and flags use the plain-value encoding of :mod:`hora.engine.codec`. Decoding checks every
field's type, so a frame either yields exactly what a hora rank could have sent or raises
:class:`~hora.engine.codec.FrameError`.

    frame   := version:u16  count:u32  entry*count  flags
    entry   := form:u8  id:u32  [name_len:u32 name]  [request]  [data_len:u32 data]
    form    :  0 cached id, 1 cached id + name (an unnamed op), 2 request in full (a plain-value tuple of
               :class:`~hora.engine.scheduling.table.Request`'s fields); +0x80 when inline data follows
    flags   := a plain-value dict (see ``_FLAG_CHECKS``)

Example:
    >>> from hora.engine.scheduling.table import Request
    >>> req = Request("grad.0", "allreduce", "float32", (4,))
    >>> items, inline, flags = decode_round(encode_round([req, 3, (5, "noname.ps0.7")], [None, b"ab", None], {}))
    >>> items == [req, 3, (5, "noname.ps0.7")], inline, flags
    (True, [None, b'ab', None], {})
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

from hora.datapath.kinds.op import Kind
from hora.engine import codec
from hora.engine.codec import FrameError
from hora.engine.scheduling.notices import NOTICE, PASSED
from hora.engine.scheduling.table import JOIN, SHUTDOWN, UNNAMED, Entry, Request

Item = Request | int | tuple[int, str]  # a request as the response cache puts it on the wire

_HEAD = struct.Struct("<HI")  # wire version, number of entries
_ENTRY = struct.Struct("<BI")  # form, cache id
_NAMED = struct.Struct("<BII")  # form, cache id, name length
_LEN = struct.Struct("<I")
_CACHED, _CACHED_NAMED, _FULL, _INLINE = 0, 1, 2, 0x80
_NO_FLAGS = codec.encode({})
_KINDS = frozenset(k.tag for k in Kind)


def encode_round(sent: Sequence[Item], inline: Sequence[bytes | None], flags: dict[str, Any]) -> bytes:
    """The frame of one round: ``sent[i]`` with its inline data ``inline[i]`` (or None), and ``flags``."""
    parts = [_HEAD.pack(codec.WIRE_VERSION, len(sent))]
    for item, data in zip(sent, inline):
        mark = 0 if data is None else _INLINE
        if type(item) is int:
            parts.append(_ENTRY.pack(_CACHED | mark, item))
        elif type(item) is tuple:  # (id, name) of an unnamed op
            name = item[1].encode()
            parts += (_NAMED.pack(_CACHED_NAMED | mark, item[0], len(name)), name)
        else:
            parts += (_ENTRY.pack(_FULL | mark, 0), codec.encode(tuple(item)))  # type: ignore[arg-type]
        if data is not None:
            parts += (_LEN.pack(len(data)), data)
    parts.append(codec.encode(flags) if flags else _NO_FLAGS)
    return b"".join(parts)


def decode_round(data: bytes) -> tuple[list[Item], list[bytes | None], dict[str, Any]]:
    """The requests, inline data and flags of a frame made by :func:`encode_round`.

    Raises:
        FrameError: another wire version, a truncated frame, or a field that is not what a hora rank sends.
    """
    try:
        version, count = _HEAD.unpack_from(data, 0)
    except struct.error:
        raise FrameError(f"a round frame of {len(data)} bytes is shorter than its header") from None
    if version != codec.WIRE_VERSION:
        raise FrameError(f"a round frame of wire version {version}; this rank speaks wire version "
                         f"{codec.WIRE_VERSION}")
    if count > len(data):
        raise FrameError(f"a round frame claims {count} requests in {len(data)} bytes")
    at = _HEAD.size
    items: list[Item] = []
    inline: list[bytes | None] = []
    end = len(data)
    entry, length = _ENTRY.unpack_from, _LEN.unpack_from  # the steady state's loop: a few lookups per op
    try:
        for _ in range(count):
            form, ident = entry(data, at)
            at += 5
            kind = form & ~_INLINE
            if kind == _CACHED:
                items.append(ident)
            elif kind == _CACHED_NAMED:
                (n,) = length(data, at)
                at += 4 + n
                if at > end:
                    raise FrameError(f"an op name of {n} bytes runs past the frame's end ({end} bytes)")
                items.append((ident, data[at - n : at].decode()))
            elif kind == _FULL:
                fields, at = codec.decode_from(data, at)
                items.append(_request(fields))
            else:
                raise FrameError(f"unknown request form {form} at byte {at - 5}")
            if form & _INLINE:
                (n,) = length(data, at)
                at += 4 + n
                if at > end:
                    raise FrameError(f"inline data of {n} bytes runs past the frame's end ({end} bytes)")
                inline.append(data[at - n : at])
            else:
                inline.append(None)
    except struct.error:
        raise FrameError(f"truncated round frame: {len(data)} bytes end inside request {len(items) + 1} of "
                         f"{count}") from None
    except UnicodeDecodeError:
        raise FrameError(f"the name of request {len(items) + 1} is not UTF-8") from None
    if len(data) - at == len(_NO_FLAGS) and data.endswith(_NO_FLAGS):  # most rounds carry no flags
        return items, inline, {}
    return items, inline, _flags(codec.decode(memoryview(data)[at:]))


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(v) is int for v in value)


def _number(value: Any) -> bool:
    return type(value) in (int, float)


# Request's fields in order, each with the check its value must pass
_REQUEST_CHECKS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("name", lambda v: type(v) is str),
    ("kind", lambda v: v in _KINDS if type(v) is str else False),
    ("dtype", lambda v: type(v) is str),
    ("shape", _ints),
    ("reduce_op", lambda v: type(v) is int),
    ("root", lambda v: type(v) is int),
    ("prescale", _number),
    ("postscale", _number),
    ("ps", _ints),
    ("device", lambda v: type(v) is str),
    ("splits", lambda v: v is None or _ints(v)),
    ("site", lambda v: type(v) is int),
    ("where", lambda v: type(v) is str),
    ("error", lambda v: type(v) is str),
)


def _request(fields: Any) -> Request:
    if type(fields) is not tuple or len(fields) != len(_REQUEST_CHECKS):
        raise FrameError(f"a request is not a tuple of {len(_REQUEST_CHECKS)} fields: {_brief(fields)}")
    for (name, check), value in zip(_REQUEST_CHECKS, fields):
        if not check(value):
            raise FrameError(f"a request's field {name!r} is {_brief(value)}")
    return Request(*fields)


def _str_pair(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(type(v) is str for v in value)


def _str_dict(value: Any) -> bool:
    return type(value) is dict and all(type(k) is str and type(v) is str for k, v in value.items())


# the flags a round may carry, each with the check its value must pass (who sets and reads them: rounds.py,
# negotiator.py, notices.py, engine/scheduling/stall_inspector.py)
_FLAG_CHECKS: dict[str, Callable[[Any], bool]] = {
    "stall_query": lambda v: type(v) is list and all(_str_pair(q) for q in v),
    "where": lambda v: type(v) is tuple and len(v) == 2 and type(v[0]) is str and _str_dict(v[1]),
    NOTICE: lambda v: type(v) is list,
    PASSED: lambda v: type(v) is int,
}


def _flags(flags: Any) -> dict[str, Any]:
    if type(flags) is not dict:
        raise FrameError(f"a round's flags are {_brief(flags)}, not a dict")
    for key, value in flags.items():
        check = _FLAG_CHECKS.get(key)
        if check is None:
            raise FrameError(f"unknown round flag {key!r}")
        if not check(value):
            raise FrameError(f"round flag {key!r} is {_brief(value)}")
    return flags


def _brief(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# --- the response cache ------------------------------------------------------------------------------------
CAPACITY = 4096  # distinct requests remembered; later ones travel in full


def template(req: Request) -> Request:
    """The cache key of a request: an unnamed op's sequence name changes every call, its template does not."""
    return named(req, "") if req.name.startswith(UNNAMED) else req


def named(req: Request, name: str) -> Request:
    """``req`` under another name (``req._replace(name=name)``, at a third of its cost: once per op)."""
    return Request(name, *req[1:])


class ResponseCache:
    """This rank's side of the cache: ids of its own requests, and every rank's request behind each id."""

    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled  # when off this rank always sends in full; it still decodes others' ids
        self._ids: dict[Request, int] = {}
        self._requests: list[dict[int, Request]] = []

    def __len__(self) -> int:
        return len(self._requests)

    def encode(self, req: Request) -> Request | int | tuple[int, str]:
        """A request as it goes on the wire: in full the first time, then as its id (or ``(id, name)``)."""
        if self.enabled:
            cached = self._ids.get(template(req))
            if cached is not None:
                return (cached, req.name) if req.name.startswith(UNNAMED) else cached
        return req

    def decode(self, item: Request | int | tuple[int, str], rank: int) -> Request:
        """The request ``rank`` meant by ``item``."""
        if isinstance(item, int):
            return self._requests[item][rank]
        if isinstance(item, tuple) and len(item) == 2:
            return named(self._requests[item[0]][rank], item[1])
        return item  # type: ignore[return-value]

    def remember(self, entry: Entry) -> None:
        """Give a ready entry that some rank sent in full a new id (the same id on every rank)."""
        if not entry.fresh or entry.first.kind in (JOIN, SHUTDOWN) or len(self._requests) >= CAPACITY:
            return
        mine = entry.requests.get(self.rank)
        if mine is not None:
            self._ids[template(mine)] = len(self._requests)
        self._requests.append({r: template(q) for r, q in entry.requests.items()})
