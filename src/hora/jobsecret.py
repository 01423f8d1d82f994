"""The job's secret: what every process of one job holds and no stranger on the network does.

Whatever starts a job makes one :class:`JobSecret` (``hora run``, ``hora.run``; under an external launcher the
user supplies it through a file, see docs/security.md) and hands it to the job's processes the way the job spec
travels: on an agent's stdin, then in the environment of each rank's own process (``HORA_SECRET``), never on a
command line. Everything hora reads from the store or the control plane is checked against a MAC made with it
before it is parsed.

Only the standard library is used here: the launcher's agent imports this module.

Example:
    >>> secret = JobSecret.generate()
    >>> tag = secret.mac(b"job-1", b"key", b"value")
    >>> secret.verify(tag, b"job-1", b"key", b"value")
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

SECRET_BYTES = 32  # 256 bits from os.urandom
MAC_BYTES = hashlib.sha256().digest_size
ENV_SECRET = "HORA_SECRET"  # hex; set by hora's launcher in a rank's own environment only
ENV_SECRET_FILE = "HORA_SECRET_FILE"  # a file holding the secret (torchrun, srun, mpirun, Kubernetes)

_PART_LEN = struct.Struct("<Q")


class SecretError(ValueError):
    """A supplied secret is unusable (too short, unreadable file); the message says which and how to fix it."""


@dataclass(frozen=True, slots=True)
class JobSecret:
    """A per-job key. Its bytes never appear in ``repr``, logs or error messages."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < SECRET_BYTES:
            raise SecretError(f"a job secret needs at least {SECRET_BYTES} bytes, got {len(self.key)}")

    @classmethod
    def generate(cls) -> JobSecret:
        """A fresh random secret (what ``hora run`` and ``hora.run`` make for each job)."""
        return cls(os.urandom(SECRET_BYTES))

    @classmethod
    def from_text(cls, text: str | bytes, where: str) -> JobSecret:
        """Parse a secret as it is written in a file or a variable: hex text of at least 64 digits, or at
        least 32 raw bytes. ``where`` names the source for the error message (never the value)."""
        raw = text.encode() if isinstance(text, str) else text
        stripped = raw.strip()
        try:
            decoded = bytes.fromhex(stripped.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            decoded = b""
        key = decoded if len(decoded) >= SECRET_BYTES else stripped
        if len(key) < SECRET_BYTES:
            raise SecretError(
                f"the job secret from {where} is too short: it needs {2 * SECRET_BYTES} hex digits or "
                f"{SECRET_BYTES} bytes; make one with `python -c \"import secrets; print(secrets.token_hex(32))\"`"
            )
        return cls(key)

    @classmethod
    def from_file(cls, path: str) -> JobSecret:
        """Read a secret from ``path`` (a Kubernetes Secret's mounted file, an sbatch script's temp file)."""
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as e:
            raise SecretError(f"cannot read the job secret file {path!r} ({ENV_SECRET_FILE}): {e.strerror}") from None
        return cls.from_text(text, f"the file {path!r} ({ENV_SECRET_FILE})")

    def hex(self) -> str:
        """The secret as hex text, to hand to a process (stdin, its own environment); never to print."""
        return self.key.hex()

    def derive(self, purpose: str) -> JobSecret:
        """A subkey for one use (``"store"``, ``"mesh"``), so a MAC made for one can never pass for another."""
        return JobSecret(hmac.new(self.key, b"hora-subkey:" + purpose.encode(), hashlib.sha256).digest())

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 over ``parts``, each length-prefixed so that (``b"ab"``, ``b"c"``) != (``b"a"``, ``b"bc"``)."""
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(_PART_LEN.pack(len(part)))
            h.update(part)
        return h.digest()

    def verify(self, tag: bytes, *parts: bytes) -> bool:
        """Whether ``tag`` is this secret's MAC over ``parts`` (constant-time comparison)."""
        return hmac.compare_digest(tag, self.mac(*parts))
