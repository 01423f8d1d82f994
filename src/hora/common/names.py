"""Names of collectives that hora makes up or keeps for itself (the one home of these strings).

Ops are matched across ranks by name. An op the user leaves unnamed gets the next number of its process
set's sequence, ``noname.ps<set id>.<n>`` (a sparse allreduce's two parts add ``.indices`` / ``.values``);
``join()`` and ``shutdown()`` travel under reserved names.

Example:
    >>> unnamed(0, 17)
    'noname.ps0.17'
    >>> parse_unnamed('noname.ps2.3.values')
    (2, 3)
    >>> parse_unnamed('loss') is None
    True
"""

from __future__ import annotations

UNNAMED_PREFIX = "noname."
JOIN_NAME = "__join__"  # hvd.join(): one op of this name, on the global set, ready once every rank joined
SHUTDOWN_NAME = "__shutdown__"  # hvd.shutdown(): every rank says it is leaving


def unnamed(ps_id: int, n: int) -> str:
    """The sequence name of the ``n``-th unnamed op of process set ``ps_id``."""
    return f"{UNNAMED_PREFIX}ps{ps_id}.{n}"


def parse_unnamed(name: str) -> tuple[int, int] | None:
    """``(process set id, n)`` of a sequence name made by :func:`unnamed` (with or without a part suffix),
    None for any other name."""
    if not name.startswith(UNNAMED_PREFIX):
        return None
    ps, _, rest = name[len(UNNAMED_PREFIX):].partition(".")
    n = rest.partition(".")[0]
    if not (ps.startswith("ps") and ps[2:].isdigit() and n.isdigit()):
        return None
    return int(ps[2:]), int(n)
