"""What a control plane is (:class:`ControlPlane`: the per-round allgather and the bell idle negotiators wait
on) and which one a job gets (:func:`make_control_plane`).

Two planes carry a job of several ranks: the TCP mesh (:mod:`hora.engine.transport.mesh`, the default at every
size: one round trip per round up to ``HORA_MESH_FULL_UPTO`` ranks, recursive doubling over about log2 n
connections per rank above) and :class:`~hora.engine.transport.gloo_plane.GlooPlane`
(``HORA_CONTROL_PLANE=gloo`` only); a single process gets
:class:`~hora.engine.transport.local_plane.LocalPlane`. Every plane fails the same way
(:mod:`hora.engine.transport.faults`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hora.engine.auth.handshake import identity
from hora.engine.context import EngineContext
from hora.engine.transport.gloo_plane import GlooPlane
from hora.engine.transport.local_plane import LocalPlane
from hora.engine.transport.mesh import connect_mesh
from hora.engine.transport.round_schedule import Schedule
from hora.errors import ConfigError
from hora.protocol.network import advertised_address


class ControlPlane(Protocol):
    """What the negotiator needs: a bell for idle rounds and a per-round allgather. Planes whose rounds any
    thread may run (``inline_rounds``: the mesh, the local plane) also let it look at peers' frames before
    answering (``receive_ready``, ``has_input``, ``peek``) and silence peers' wake-ups (``quiet``). ``plan``
    is a round's schedule: whom this rank exchanges frames with (every other rank, but for the mesh's
    recursive doubling). ``on_wait`` is called while a round waits for peers (who, for how long) by the planes
    that wait in ticks (the mesh); the others never call it."""

    watches_peers: bool
    inline_rounds: bool
    plan: Schedule
    on_wait: Callable[[list[int], float], None] | None

    def ring(self, round_no: int) -> None: ...
    def wake(self) -> None: ...
    def wait(self, round_no: int, timeout: float) -> bool: ...
    def clear(self, round_no: int) -> None: ...
    def allgather(self, payload: bytes) -> list[bytes]: ...
    def peek(self) -> dict[int, bytes]: ...
    def receive_ready(self) -> None: ...
    def has_input(self) -> bool: ...
    def quiet(self, on: bool) -> None: ...
    def close(self) -> None: ...


CONTROL_PLANES = ("auto", "tcp", "gloo")
AUTO_PLANE = "tcp"  # what "auto" picks, at every size: the mesh's rounds cost O(log n) frames and connections per
# rank above HORA_MESH_FULL_UPTO ranks, against the Gloo plane's n-1 steps and a store wake-up per round


def make_control_plane(ctx: EngineContext) -> ControlPlane:
    """The control plane ``HORA_CONTROL_PLANE`` asks for (a mesh, or :class:`GlooPlane`)."""
    choice = ctx.knobs.control_plane.strip().lower()
    if choice not in CONTROL_PLANES:
        raise ConfigError(f"HORA_CONTROL_PLANE={ctx.knobs.control_plane!r}: use one of {', '.join(CONTROL_PLANES)}")
    if ctx.size == 1:
        return LocalPlane()
    if choice == "gloo":
        return GlooPlane(ctx)
    # no fixed round timeout: a peer that does not answer is the stall inspector's (Rounds.on_wait), on the
    # deadlines of --stall-check-warning-time-seconds / --stall-check-shutdown-time-seconds
    return connect_mesh(identity(ctx, "mesh"), ctx.size, ctx.store, advertised_address(ctx.store_addr),
                        ctx.knobs.start_timeout, full_upto=ctx.knobs.mesh_full_upto)
