"""The driver's handle on Ray actors that run a job's ranks (:class:`RayActors`): a
:class:`~hora.launcher.supervision.loop.Handle`, as an agent on a host is under ``hora run``, so the launcher's run
loop supervises them: an elastic Ray job's workers (:mod:`hora.ray.elastic`) and a fixed ``RayExecutor`` job's
ranks (:mod:`hora.ray.executor`).

Each actor runs one call (the user's function); a thread of the handle waits on the calls and turns each end into
an ``exit`` message: its value, the exception it raised (its traceback as the rank's stderr lines), or Ray's word
that the actor died (killed, out of memory, its node lost). Stopping a rank kills its actor: Ray gives it no grace.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions

from hora.protocol import messages as protocol

log = logging.getLogger(__name__)

# at the end, how long killed actors get to report their end, after the run loop's own wait for every handle
REPORT_WAIT_S = 5.0


@dataclass
class RayActor:
    """One rank's actor and its call."""

    number: int  # the rank's process number in the driver's messages
    actor: Any
    node_id: str
    host: str
    run: Any  # the ObjectRef of the user's function
    described: Any = None  # the ObjectRef of the actor's (node id, address, hostname, pid), when asked
    stopping: bool = False
    ended: bool = False  # its call has ended
    value: Any = None
    error: BaseException | None = None

    def where(self) -> str:
        """Where it runs, in the words of the driver's lines."""
        if self.described is None:
            return f"node {self.host} (Ray node {self.node_id[:8]})"
        try:
            _node, ip, _hostname, pid = ray.get(self.described, timeout=0.5)
            return f"node {ip} (Ray node {self.node_id[:8]}, pid {pid})"
        except Exception:  # noqa: BLE001 - it never started, or it is gone: what the driver placed it on
            return f"node {self.host} (Ray node {self.node_id[:8]})"


@dataclass(eq=False)
class RayActors:
    """The driver's handle on a batch of workers started together on one host, one Ray actor each: a
    :class:`~hora.launcher.supervision.loop.Handle`, the part an agent plays under ``hora run``. A thread waits on
    the actors' run calls and turns each end into the driver's ``exit`` message; ``stop`` kills actors (Ray gives a
    worker no grace: its peers reset to their last commit either way).

    Args:
        index: its place in the driver's handles.
        host: the host its actors run on.
        ranks: the numbers of its worker processes.
        keep: its actors outlive their calls (a fixed ``RayExecutor`` runs one call after another in them); else each
            actor is killed once its call ended, its CPUs (or GPUs) back to Ray for a newcomer.
    """

    index: int
    host: str
    ranks: list[int]
    actors: dict[int, RayActor] = field(default_factory=dict)
    keep: bool = False
    remote: bool = False  # Ray reports each actor's end itself: the handle never ends before its workers
    started: bool = False
    finished: bool = False
    ended: threading.Event = field(default_factory=threading.Event)

    def watch(self, events: Any) -> None:
        threading.Thread(target=self._watch, args=(events,), daemon=True, name=f"hora-ray-{self.host}").start()

    def _watch(self, events: Any) -> None:
        events.put(("msg", self.index, {"t": protocol.STARTED, "hostname": self.host}))
        pending = {a.run: a for a in self.actors.values()}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                a = pending.pop(ref)
                end = self._exit(a)
                a.ended = True
                if not self.keep:  # its process ends with its function, as a worker's does under hora run
                    self._release(a)
                for text in traceback_lines(a.error):  # the worker's own report, as its stderr under hora run
                    events.put(("msg", self.index, {"t": protocol.OUT, "r": a.number, "s": "stderr", "l": text,
                                                    "ts": end["ts"]}))
                events.put(("msg", self.index, end))
        self.ended.set()
        events.put(("eof", self.index, 0))

    def _exit(self, a: RayActor) -> dict[str, Any]:
        message: dict[str, Any] = {"t": protocol.EXIT, "r": a.number, "code": 0, "stopped": a.stopping,
                                   "ts": time.time()}
        try:
            a.value = ray.get(a.run)
        except ray.exceptions.RayTaskError as e:  # the function raised in the actor
            cause = e.cause if isinstance(e.cause, BaseException) else e
            a.error = e
            message.update(code=1, how=f"raised {type(cause).__name__}: {cause}", raised=type(cause).__name__)
        except ray.exceptions.RayError as e:  # the actor died: killed, out of memory, its node lost
            a.error = e
            message.update(code=1, how=f"its Ray actor died ({type(e).__name__}: killed, out of memory, or its "
                                       "node was lost)")
        return message

    def send(self, message: dict[str, Any]) -> None:
        if message.get("t") != protocol.STOP:
            return  # pings and stall probes: Ray's own liveness stands in for an agent's
        numbers = message.get("r")
        for a in self.actors.values():
            if numbers is None or a.number in numbers:
                self._stop(a)

    def close(self) -> None:
        """No more orders: every actor whose call still runs is killed."""
        for a in self.actors.values():
            if not a.ended:
                self._stop(a)

    def running(self) -> bool:
        return not self.ended.is_set()

    def wait(self, timeout: float) -> bool:
        return self.ended.wait(max(0.0, timeout))

    def kill(self) -> None:
        """Kill every actor whose call still runs and give Ray a bounded time to report their ends."""
        self.close()
        if not self.ended.wait(REPORT_WAIT_S):
            log.warning("hora.ray: the actors on %s did not report their end within %.0f s", self.host,
                        REPORT_WAIT_S)

    def lost(self, code: int, who: str) -> str:
        return f"lost: the Ray actors on {self.host} ended before {who} exited"

    @staticmethod
    def _stop(a: RayActor) -> None:
        a.stopping = True
        RayActors._release(a)

    @staticmethod
    def _release(a: RayActor) -> None:
        try:
            ray.kill(a.actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already gone
            log.debug("hora.ray: actor of worker %d already gone: %s", a.number, e)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CARETS = re.compile(r"^\s*\^+\s*$")


def traceback_lines(error: BaseException | None) -> list[str]:
    """The traceback a worker's function raised with, as Ray words it (its ``ray::...execute() (pid, ip)`` line,
    then the frames), colours and the carets of Ray's own frame removed; none for a dead actor."""
    if not isinstance(error, ray.exceptions.RayTaskError):
        return []
    lines = _ANSI.sub("", str(error)).rstrip("\n").splitlines()
    first_frame = next((i for i, text in enumerate(lines) if text.lstrip().startswith("File ")), len(lines))
    return [text for i, text in enumerate(lines) if i >= first_frame or not _CARETS.match(text)]
