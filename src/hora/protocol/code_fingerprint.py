"""A fingerprint of the hora code installed: tells two installs apart that share a version string.

Two hosts can both say "hora 0.1.0" and run different code (an editable checkout with local changes, a
patched copy, a build from another commit); their ranks then disagree on what a frame means. The fingerprint
is a SHA-256 over every ``.py`` file of the ``hora`` package (its path inside the package and its bytes, in
sorted order), computed once per process. ``hora run``'s preflight compares it across hosts, and ranks
compare it when their control connections meet (:mod:`hora.engine.auth.handshake`).

This module imports only the standard library and nothing of hora, because preflight runs its source on
each remote host (:data:`hora.launcher.remote.preflight.PROBE`) without importing hora there.

Example:
    >>> len(code_fingerprint())
    64
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from importlib import metadata


def fingerprint_of(root: str) -> str:
    """The fingerprint of the package in directory ``root`` (hex); ``"unknown"`` if it cannot be read."""
    digest = hashlib.sha256()
    try:
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            found += [os.path.join(folder, f) for f in files if f.endswith(".py")]
        for path in sorted(found):
            with open(path, "rb") as fh:
                body = fh.read()
            name = os.path.relpath(path, root).replace(os.sep, "/").encode()
            digest.update(len(name).to_bytes(8, "little") + name + len(body).to_bytes(8, "little"))
            digest.update(body)
    except OSError:
        return "unknown"
    return digest.hexdigest()


def package_root(name: str = "hora") -> str | None:
    """Where the package ``name`` would be imported from (it is not imported), or None."""
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


@functools.cache
def code_fingerprint() -> str:
    """This process's hora code's fingerprint (hex SHA-256; computed on first use, then remembered)."""
    root = package_root()
    return fingerprint_of(root) if root is not None else "unknown"


@functools.cache
def installed_version() -> str:
    """hora's version string as installed (what preflight compares), or "unknown"."""
    try:
        return metadata.version("hora")
    except metadata.PackageNotFoundError:
        return "unknown"


def short(fingerprint: str) -> str:
    """The first 12 hex digits, for messages (enough to tell builds apart at a glance)."""
    return fingerprint[:12]
