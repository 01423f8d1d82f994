"""The job's secret: what every process of one job holds and no stranger on the network does.

Whatever starts a job makes one :class:`JobSecret` (``hora run``, ``hora.run``; under an external launcher the
user supplies it through a file, see docs/security.md) and hands it to the job's processes the way the job spec
travels: on an agent's stdin, then in the environment of each rank's own process (``HORA_SECRET``), never on a
command line. Everything hora reads from the store or the control plane is checked against a MAC made with it
before it is parsed.

Only the standard library is used here: the launcher's agent imports this module. ``hora secret FILE``
(:func:`main`) writes a fresh secret to a file only its owner can read, for the external launchers.

Example:
    >>> secret = JobSecret.generate()
    >>> tag = secret.mac(b"job-1", b"key", b"value")
    >>> secret.verify(tag, b"job-1", b"key", b"value")
    True
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    _keyed: Any = field(init=False, repr=False, compare=False)  # HMAC state after the key: copied per MAC

    def __post_init__(self) -> None:
        if len(self.key) < SECRET_BYTES:
            raise SecretError(f"a job secret needs at least {SECRET_BYTES} bytes, got {len(self.key)}")
        object.__setattr__(self, "_keyed", hmac.new(self.key, digestmod=hashlib.sha256))

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
        key = decoded if len(decoded) >= SECRET_BYTES else raw  # raw bytes are the key as they are, whitespace too
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

    def write_file(self, path: str, *, replace: bool = False) -> None:
        """Write the secret as hex to ``path``, readable by its owner only (mode 0600).

        Raises:
            SecretError: ``path`` exists (and ``replace`` is False) or cannot be written.
        """
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise SecretError(f"{path} exists: give another file, or --force to replace its secret") from None
        except OSError as e:
            raise SecretError(f"cannot write the job secret file {path!r}: {e.strerror}") from None
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(fd, 0o600)  # a replaced file keeps no wider mode it had
                f.write(self.hex() + "\n")
        except OSError as e:  # a full disk, a quota: no half-written secret is left behind
            os.unlink(path)
            raise SecretError(f"cannot write the job secret file {path!r}: {e.strerror or e}") from None

    def hex(self) -> str:
        """The secret as hex text, to hand to a process (stdin, its own environment); never to print."""
        return self.key.hex()

    def derive(self, purpose: str) -> JobSecret:
        """A subkey for one use (``"store"``, ``"mesh"``), so a MAC made for one can never pass for another."""
        return JobSecret(hmac.new(self.key, b"hora-subkey:" + purpose.encode(), hashlib.sha256).digest())

    def mac(self, *parts: bytes | memoryview) -> bytes:
        """HMAC-SHA256 over ``parts``, each length-prefixed so that (``b"ab"``, ``b"c"``) != (``b"a"``, ``b"bc"``)."""
        h = self._keyed.copy()  # the key's two hash blocks are not hashed again for every MAC
        for part in parts:
            h.update(_PART_LEN.pack(len(part)))
            h.update(part)
        return h.digest()

    def verify(self, tag: bytes, *parts: bytes | memoryview) -> bool:
        """Whether ``tag`` is this secret's MAC over ``parts`` (constant-time comparison)."""
        return hmac.compare_digest(tag, self.mac(*parts))


def main(argv: Sequence[str] | None = None) -> int:
    """``hora secret FILE``: write a new job secret to FILE (mode 0600), or to stdout with ``-`` (to pipe into
    ``kubectl create secret``); the exit code (2 for a usage error or a file that exists)."""
    parser = argparse.ArgumentParser(
        prog="hora secret", description=(
            "Make a new job secret (256 bits from os.urandom) for a job started without hora run: give every "
            "process of the job the file with HORA_SECRET_FILE=FILE (torchrun, srun, mpirun), or put it in a "
            "Kubernetes Secret. hora run and hora.run make their own. See docs/security.md."),
        epilog="examples:\n  hora secret ~/jobs/train.secret\n"
               "  hora secret - | kubectl create secret generic hora-job-secret --from-file=secret=/dev/stdin",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", metavar="FILE", help="where to write it (created with mode 0600); - for stdout")
    parser.add_argument("--force", action="store_true", help="replace the secret in FILE if it exists")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    secret = JobSecret.generate()
    if args.file == "-":
        sys.stdout.write(secret.hex() + "\n")
        return 0
    try:
        secret.write_file(args.file, replace=args.force)
    except SecretError as e:
        sys.stderr.write(f"hora secret: error: {e}\n")
        return 2
    sys.stderr.write(f"hora secret: wrote a new job secret to {args.file} (mode 0600); give every process of the job "
                     f"{ENV_SECRET_FILE}={args.file}\n")
    return 0
