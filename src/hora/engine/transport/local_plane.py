"""The planes whose peers' frames exist only inside their allgather (:class:`UnreadPlane`: the Gloo plane and
this one), and :class:`LocalPlane`, the control plane of a single-process job."""

from __future__ import annotations

import threading
from collections.abc import Callable

from hora.engine.transport.round_schedule import full


class UnreadPlane:
    """A plane whose peers' frames exist only inside its allgather: nothing to look at, read or silence
    between rounds, so every woken rank answers at once."""

    on_wait: Callable[[list[int], float], None] | None = None  # never called: its waits have no ticks

    def peek(self) -> dict[int, bytes]:
        return {}

    def receive_ready(self) -> None:
        pass

    def has_input(self) -> bool:
        return False

    def quiet(self, on: bool) -> None:
        pass


class LocalPlane(UnreadPlane):
    """The control plane of a single-process job: a round is local, so it runs on whichever thread needs it
    (no peers to read, no Gloo call, no store)."""

    watches_peers = True  # no peers
    inline_rounds = True

    def __init__(self) -> None:
        self.plan = full(0, 1)
        self._cond = threading.Condition()
        self._rung = False

    def ring(self, round_no: int) -> None:
        with self._cond:
            self._rung = True
            self._cond.notify()

    def wake(self) -> None:
        self.ring(0)

    def wait(self, round_no: int, timeout: float) -> bool:
        with self._cond:
            rung = self._cond.wait_for(lambda: self._rung, timeout)
            self._rung = False
            return rung

    def allgather(self, payload: bytes) -> list[bytes]:
        return [payload]

    def clear(self, round_no: int) -> None:
        pass

    def close(self) -> None:
        pass
