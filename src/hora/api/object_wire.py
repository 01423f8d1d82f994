"""The bytes ``broadcast_object`` and ``allgather_object`` send: pickled, sealed with the job's secret, and
checked before anything is unpickled.

Those two carry arbitrary Python objects (Horovod's contract: a script broadcasts its own classes) over the
data plane, whose Gloo and NCCL connections carry no authentication (docs/security.md): a stranger who points
a rank's Gloo connection at itself can change the bytes on the way. Unpickling such bytes runs the stranger's
code, so what travels is one of these, per sender:

- with a job secret: ``tag + kind + body``, where ``tag`` is an HMAC-SHA256 under a key derived from the secret
  for this use, over the world (job id and generation), a domain tag, the collective (broadcast or
  allgather, its process set, its name and how many times that name was sent in this world), the sender's
  rank and ``kind + body`` (SHA-256 rather than BLAKE2b: with the CPUs' SHA instructions it hashes large
  objects about twice as fast, docs/security.md). Only bytes whose tag checks are unpickled
  (``torch.load(weights_only=False)``): a changed byte, another sender's, another job's or world's bytes, or
  an earlier call's (a replay) are refused with :class:`~hora.errors.ObjectAuthError` before any byte is
  unpickled.
- without one: ``kind + body``, loaded with ``torch.load(weights_only=True)``: tensors, numbers, strings and
  the plain containers (and what ``torch.serialization.add_safe_globals`` allows), which cannot run code. A
  sender whose object needs more refuses it itself, before sending (``kind`` R, the reason as ``body``), so
  every member raises the same :class:`~hora.errors.UnsafeObjectError`, naming the fix.

Tensors always arrive on the CPU (``map_location="cpu"``), whatever device the sender's were on. A rank's own
bytes (its own slot of an allgather) never crossed the network and are loaded without a check.

Example:
    >>> from hora.protocol.jobsecret import JobSecret
    >>> wire = ObjectWire(JobSecret.generate(), "hora/ab12/g1")
    >>> call = wire.call("broadcast", 0, "cfg")
    >>> sealed = wire.seal(call, 0, encode({"lr": 0.1}))
    >>> wire.open(call, 0, sealed, mine=False)
    {'lr': 0.1}
"""

from __future__ import annotations

import hmac
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from hora.common.trusted_load import unsafe_reason
from hora.errors import ObjectAuthError, UnsafeObjectError
from hora.protocol.jobsecret import JobSecret

TAG_BYTES = 32
OBJECT, REFUSED = b"O", b"R"  # the kind byte: a pickled object, or the sender's refusal (its reason)
_DOMAIN = b"hora-object-v1"
_PART = struct.Struct("<Q")
HOW_TO_SECRET = ("give the job a secret (hora run and hora.run make one; under other launchers set "
                 "HORA_SECRET_FILE on every rank, see docs/security.md), or allow the classes on every rank with "
                 "torch.serialization.add_safe_globals([...])")


@dataclass(frozen=True, slots=True)
class Call:
    """One call of broadcast_object or allgather_object, as every member numbers it."""

    header: bytes  # what the tag binds besides the sender and the bytes
    label: str  # the collective in words, for errors


def encode(obj: Any) -> bytes:
    """``obj`` pickled by ``torch.save`` (tensors keep their storage sharing and dtype)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class ObjectWire:
    """The object path's sealing in one world: the key, and how often each name was sent (module docstring).

    Args:
        secret: the job's secret; None: nothing is sealed and only safe types are loaded.
        world: the world's name (job id and generation), bound into every tag.
    """

    def __init__(self, secret: JobSecret | None, world: str) -> None:
        self.world = world
        self._keyed = secret.derive("data-objects") if secret is not None else None
        self._world = world.encode()
        self._sent: dict[tuple[str, int, str], int] = {}

    @property
    def sealed(self) -> bool:
        return self._keyed is not None

    def call(self, kind: str, process_set: int, name: str) -> Call:
        """The next call of ``kind`` ("broadcast", "allgather") named ``name`` on ``process_set`` (every member
        calls it in the same order, so every member numbers it the same)."""
        slot = (kind, process_set, name)
        count = self._sent.get(slot, 0)
        self._sent[slot] = count + 1
        header = b"".join(_PART.pack(len(p)) + p for p in (
            _DOMAIN, self._world, kind.encode(), str(process_set).encode(), name.encode(), str(count).encode()))
        return Call(header, f"{kind}_object {name!r}")

    def _tag(self, call: Call, sender: int, data: memoryview) -> bytes:
        assert self._keyed is not None
        return self._keyed.mac(call.header, _PART.pack(sender), data)

    def seal(self, call: Call, sender: int, pickled: bytes) -> bytes:
        """What ``sender`` sends for its pickled object. Without a secret the object is checked first: one
        that needs more than the safe types is replaced by a refusal that every member raises."""
        if self._keyed is None:
            problem = _needs_code(pickled)
            body = OBJECT + pickled if problem is None else REFUSED + problem.encode()
            return body
        body = OBJECT + pickled
        return self._tag(call, sender, memoryview(body)) + body

    def raise_if_refused(self, call: Call, sender: int, sealed: bytes) -> None:
        """Raise, on the sender, the :class:`~hora.errors.UnsafeObjectError` its members raise for ``sealed``."""
        if self._keyed is None and sealed[:1] == REFUSED:
            self.open(call, sender, sealed, mine=True)

    def open(self, call: Call, sender: int, data: bytes | memoryview, mine: bool) -> Any:
        """The object ``sender`` sent as ``data``, once checked (``mine``: this rank's own bytes).

        Raises:
            ObjectAuthError: the bytes do not carry ``sender``'s tag for this call (nothing was unpickled).
            UnsafeObjectError: the sender refused its object (no secret, and it needs code to unpickle).
        """
        view = memoryview(data)
        if self._keyed is not None:
            tag, view = view[:TAG_BYTES], view[TAG_BYTES:]
            if not mine and (len(tag) != TAG_BYTES
                             or not hmac.compare_digest(bytes(tag), self._tag(call, sender, view))):
                raise ObjectAuthError(
                    f"{call.label}: the bytes of rank {sender}'s object failed authentication and were not "
                    "unpickled: they were changed on the way, or sent by a process without this job's secret (a "
                    "stranger on the data plane's network: run the job on a network of its own, see "
                    "docs/security.md)")
        kind, body = bytes(view[:1]), view[1:]
        if kind == REFUSED:
            raise UnsafeObjectError(f"{call.label}: rank {sender}'s object cannot be sent in a job without a secret: "
                                    f"{bytes(body).decode(errors='replace')}; {HOW_TO_SECRET}")
        if kind != OBJECT:
            raise ObjectAuthError(f"{call.label}: the bytes of rank {sender}'s object are not an object hora sent (a "
                                  "stranger on the data plane's network?); nothing was unpickled")
        trusted = mine or self._keyed is not None
        try:
            return torch.load(io.BytesIO(body), map_location="cpu", weights_only=not trusted)
        except pickle.UnpicklingError as e:
            if trusted:
                raise
            raise UnsafeObjectError(f"{call.label}: rank {sender}'s object was not unpickled: {unsafe_reason(e)}; "
                                    f"{HOW_TO_SECRET}") from None


def _needs_code(pickled: bytes) -> str | None:
    """Why a pickled object cannot be loaded with ``weights_only=True``, or None when it can (the check a
    sender without a secret makes, so that it refuses its own object rather than its peers failing alone)."""
    try:
        torch.load(io.BytesIO(pickled), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        return unsafe_reason(e)
    return None
