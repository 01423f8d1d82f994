"""The job's rendezvous store: the ``TCPStore`` the launcher hosts for every rank of a job (it outlives any
worker, which elastic jobs need), on a port the system picks, listening on the job's address only
(:func:`hora.common.rendezvous.serve`). The drivers read and write it through
:class:`hora.protocol.signedstore.SignedStore`.

Here so that usage errors and ``--help`` answer without loading torch: this is the launch side's only torch
import, made when the store starts.

Example:
    >>> store = listen("127.0.0.1", 60.0)  # doctest: +SKIP
    >>> store.port  # doctest: +SKIP
    41234
"""

from __future__ import annotations

import datetime
import errno
import re
from typing import Any

from hora.errors import SetupError

_MESSAGE = re.compile(r"name: (\w+), message: (.+)$")


def listen(addr: str, timeout_s: float) -> Any:
    """Start the store; the workers will reach it at ``addr``.

    Raises:
        SetupError: (exit code 2; nothing was started) it cannot listen, as one line naming the address.
    """
    from hora.common import rendezvous

    try:
        return rendezvous.serve(addr, 0, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        found = _MESSAGE.search(text)
        name, reason = (found.group(1), found.group(2)) if found else ("", text)
        if isinstance(exc, OSError) and exc.errno is not None and exc.errno in errno.errorcode and exc.strerror:
            name, reason = errno.errorcode[exc.errno], exc.strerror[:1].lower() + exc.strerror[1:]
        hint = {
            "EADDRINUSE": "no free port: every port of net.ipv4.ip_local_port_range is taken on this machine; "
                          "close what holds them, or widen the range",
            "EADDRNOTAVAIL": "that address is not on this machine; pass --network-interface",
        }.get(name, "check this machine's network settings, or pass --network-interface")
        raise SetupError(f"cannot start the rendezvous store for the workers to reach at {addr} (on a port the "
                         f"system picks): {reason}; {hint}") from None
