"""The rendezvous store as hora reads and writes it: every value carries a MAC, checked before it is used.

The job's store (a torch ``TCPStore``) answers any client that reaches its port, and lets it list, read,
overwrite and delete every key. So every value hora writes goes in as ``b"M" + tag + value``, where ``tag`` is
an HMAC-SHA256, under the job secret's ``"store"`` subkey, over the job id, the full key and the value; every
value hora reads is checked before it is parsed (or unpickled: ``hora.run``'s function and results), and one
that fails raises :class:`~hora.errors.StoreAuthError`, one line naming the key and the store's address. A
value can therefore not be forged, nor moved to another key or another job; what a stranger can still do
(delete keys, replay a key's older value, touch the counters and the torch keys) is listed in
docs/security.md.

Without a secret (an external launcher with none configured: docs/security.md) values go in as
``b"P" + value``: nothing is authenticated, but a rank with a secret and one without are told apart at the
first value, with a message saying which one lacks it.

Counters (``add``) hold a plain number the store itself increments: they cannot carry a MAC and are read as
hints only (the values they point to are checked). Only the standard library is used here: the launcher's
driver imports this module without torch.

Example:
    >>> from torch.distributed import HashStore
    >>> store = SignedStore(HashStore(), JobSecret.generate(), "job1", "127.0.0.1:29500")
    >>> store.under("hora/job1").set("mesh/0", "10.0.0.2:4100")
    >>> store.get("hora/job1/mesh/0")
    b'10.0.0.2:4100'
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Sequence
from typing import Any

from hora.errors import StoreAuthError
from hora.protocol.jobsecret import MAC_BYTES, JobSecret

log = logging.getLogger(__name__)

SIGNED, PLAIN = b"M", b"P"  # the first byte of every value hora writes: with a MAC, or without (no secret)
_HELP = "see docs/security.md"
_warned: set[str] = set()  # keys whose ignored value was logged (once each: a polling reader logs it once)
_warned_lock = threading.Lock()


def ignored(error: StoreAuthError) -> None:
    """Log, once per key, that a value which failed authentication was ignored (for readers whose values only
    add information, such as the board: the job goes on without it)."""
    with _warned_lock:
        if error.key in _warned:
            return
        _warned.add(error.key)
    log.warning("%s; ignored", error)


class SignedStore:
    """A view of the job's store in which every value hora writes is authenticated and every value it reads
    is checked (see the module docstring).

    Args:
        raw: the torch store (a ``TCPStore``, a ``PrefixStore`` of one, a ``HashStore``).
        secret: the job's secret; None: values travel unauthenticated (a job without a secret).
        job_id: the job's id (bound into every MAC, so a value cannot pass into another job).
        address: ``host:port`` of the store, for error messages.
        prefix: keys of this view are ``prefix + key`` in ``raw`` (see :meth:`under`).
    """

    __slots__ = ("raw", "secret", "job_id", "address", "prefix", "_key", "_job")

    def __init__(self, raw: Any, secret: JobSecret | None, job_id: str, address: str, prefix: str = "") -> None:
        self.raw = raw
        self.secret = secret
        self.job_id = job_id
        self.address = address
        self.prefix = prefix
        self._key = secret.derive("store") if secret is not None else None
        self._job = job_id.encode()

    @property
    def authenticated(self) -> bool:
        """True when values carry a MAC (the job has a secret)."""
        return self._key is not None

    def under(self, prefix: str) -> SignedStore:
        """The view of the keys under ``prefix`` (``prefix/key``, as torch's ``PrefixStore`` names them)."""
        view = SignedStore.__new__(SignedStore)
        view.raw, view.secret, view.job_id, view.address = self.raw, self.secret, self.job_id, self.address
        view.prefix, view._key, view._job = f"{self.prefix}{prefix}/", self._key, self._job
        return view

    # --- values -------------------------------------------------------------------------------------------
    def seal(self, key: str, value: str | bytes) -> bytes:
        """What goes into the raw store for ``value`` under this view's ``key``."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        if self._key is None:
            return PLAIN + data
        return SIGNED + self._key.mac(self._job, (self.prefix + key).encode(), data) + data

    def open(self, key: str, stored: bytes) -> bytes:
        """The value sealed in ``stored`` (read from this view's ``key``), once its MAC is checked.

        Raises:
            StoreAuthError: the value was not written by a process holding this job's secret.
        """
        full = self.prefix + key
        kind = stored[:1]
        if self._key is None:
            if kind == PLAIN:
                return stored[1:]
            why = ("it was written with a job secret and this process has none: give every process of the job the "
                   "same HORA_SECRET_FILE" if kind == SIGNED else "it was not written by hora")
            raise self._refused(full, why)
        if kind == SIGNED and len(stored) >= 1 + MAC_BYTES:
            data = stored[1 + MAC_BYTES:]
            if self._key.verify(stored[1:1 + MAC_BYTES], self._job, full.encode(), data):
                return data
        why = ("it was written without a job secret and this process has one: give every process of the job the "
               "same HORA_SECRET_FILE" if kind == PLAIN else
               "its MAC does not match this job's secret: a process without the secret wrote it")
        raise self._refused(full, why)

    def _refused(self, full: str, why: str) -> StoreAuthError:
        return StoreAuthError(
            f"the value of store key {full!r} on the rendezvous store at {self.address} failed authentication "
            f"and was not used: {why} (a stranger on the network, or a process of another job; {_HELP})", key=full)

    # --- the store's operations, as dist.Store names them -------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.raw.set(self.prefix + key, self.seal(key, value))

    def get(self, key: str) -> bytes:
        """The checked value of ``key`` (waits for the key as the raw store's ``get`` does)."""
        return self.open(key, self.raw.get(self.prefix + key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The checked values of ``keys``, in one round trip where the store can."""
        full = [self.prefix + k for k in keys]
        many = getattr(self.raw, "multi_get", None)
        stored = many(full) if many is not None else [self.raw.get(k) for k in full]
        return [self.open(k, s) for k, s in zip(keys, stored, strict=True)]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if it is absent); the checked value it
        holds afterwards."""
        want = b"" if expected in ("", b"") else self.seal(key, expected)
        return self.open(key, self.raw.compare_set(self.prefix + key, want, self.seal(key, desired)))

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists (existence only: read the value with :meth:`get` to use it)."""
        return bool(self.raw.check([self.prefix + k for k in keys]))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key exists (existence only, as :meth:`check`)."""
        full = [self.prefix + k for k in keys]
        if timeout is None:
            self.raw.wait(full)
        else:
            self.raw.wait(full, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.raw.delete_key(self.prefix + key))

    def add(self, key: str, amount: int) -> int:
        """Add to the counter ``key``. A counter carries no MAC (the store increments it): a stranger can change
        it, so hora reads counters as hints only and checks the values they point to (docs/security.md)."""
        return int(self.raw.add(self.prefix + key, amount))
