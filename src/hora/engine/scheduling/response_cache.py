"""The response cache: a request seen before with identical metadata travels as a small integer.

Every rank runs :meth:`ResponseCache.remember` on the same ready entries in the same order, so cache ids
agree everywhere without any extra message. A named op is cached as is; an unnamed op, whose sequence name
changes every call, is cached by *template* (its request without the name) and sent as ``(id, name)``. In
steady state a round of the optimizer's bucket allreduces carries a few bytes per rank.
"""

from __future__ import annotations

from hora.engine.scheduling.table import JOIN, SHUTDOWN, UNNAMED, Entry, Request

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
