"""Loading with ``torch.load`` what another user could have written: the rules every checkpoint reader follows.

``torch.load(weights_only=False)`` unpickles, and unpickling runs whatever code the file names. A checkpoint
directory on shared storage (NFS, a PVC, a cluster's scratch) is a place other users may reach, so whatever
hora writes or reads there follows three rules, as small functions every checkpoint format uses
(``hora.checkpoint``'s files, and sharded checkpoints):

- :func:`private_directory`: a directory hora creates is the job's user's alone (mode 0700); an existing one
  that other users may write to gets one warning naming it and the fix.
- :func:`open_owned`: a file is opened first and then checked, on the open descriptor (no race with a
  rename): one owned by another user (root's excepted: root can change anything anyway) is refused with a
  :class:`~hora.errors.CheckpointError` naming the file, its owner and the fix.
- :func:`load_owned`: a file passes :func:`open_owned`, then loads with ``weights_only=True`` unless the
  caller opts out: tensors, numbers, strings and plain containers, never code. A file that needs more is
  refused with a message naming the classes (:func:`unsafe_reason`) and both ways out.

Example:
    >>> import tempfile, torch
    >>> where = private_directory(tempfile.mkdtemp() + "/run1")
    >>> torch.save({"epoch": 3}, where / "ckpt.pt")
    >>> load_owned(where / "ckpt.pt", map_location="cpu")
    {'epoch': 3}
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import stat
from pathlib import Path
from typing import IO, Any

import torch

from hora.errors import CheckpointError

log = logging.getLogger(__name__)

DIRECTORY_MODE = 0o700
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")  # torch's weights_only refusal: the class it names
_DETAIL = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")
_warned: set[str] = set()


class UnsafeToLoad(Exception):
    """A file or payload needs code to unpickle (``weights_only=True`` refused it); the message says what."""


def private_directory(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory the job's user alone may enter (created with mode 0700, its missing parents
    too); an existing one writable by other users is kept, with one warning naming it and the fix."""
    where = Path(path)
    missing = []
    probe = where
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:  # another rank or job made it meanwhile
            continue
        os.chmod(folder, DIRECTORY_MODE)  # mkdir's mode passes through the umask; 0700 is what we want
    if not missing:
        _warn_if_shared(where)
    return where


def _warn_if_shared(where: Path) -> None:
    try:
        info = where.stat()
    except OSError:
        return
    others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not others_write or info.st_mode & stat.S_ISVTX or str(where) in _warned:
        return  # a sticky directory (/tmp): other users cannot rename or remove this job's files
    _warned.add(str(where))
    log.warning("%s is writable by other users (mode %o): they can replace the checkpoints there, and hora "
                "refuses files they wrote at restore; give the job a directory of its own (chmod 700 %s)",
                where, stat.S_IMODE(info.st_mode), where)


def open_owned(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for reading, once its owner is the job's user (or root).

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: another user owns it (the message names the file, the owner and the fix).
    """
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    try:
        owner = os.fstat(f.fileno()).st_uid
        if owner not in (os.geteuid(), 0):
            raise CheckpointError(
                f"{path} is owned by {_user(owner)}, not by this job's user {_user(os.geteuid())}: hora does not "
                "load files another user wrote (loading one can run their code). Move it away, or if you trust "
                f"it, take it over (`chown {_name(os.geteuid())} {path}`)")
    except BaseException:
        f.close()
        raise
    return f


def load_owned(path: str | os.PathLike[str], map_location: Any = "cpu", *, weights_only: bool = True) -> Any:
    """``torch.load`` of a file that passes :func:`open_owned`; with ``weights_only`` (the default) only
    tensors and plain values load.

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: another user owns it.
        UnsafeToLoad: it needs more than ``weights_only=True`` loads (the message names what and the fix).
    """
    with open_owned(path) as f:
        try:
            return torch.load(f, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as e:
            if weights_only and _GLOBAL.search(str(e)):  # not a damaged file: a class weights_only does not load
                raise UnsafeToLoad(unsafe_reason(e)) from None
            raise


def unsafe_reason(error: pickle.UnpicklingError) -> str:
    """What a ``weights_only=True`` load refused, in one line: the classes it named, or torch's reason."""
    found = _GLOBAL.findall(str(error))
    if found:
        return (f"it holds {', '.join(dict.fromkeys(found))}, which only an unrestricted unpickler can load (it "
                "could run code)")
    detail = _DETAIL.search(str(error))
    return f"it holds more than tensors and plain values ({(detail.group(1) if detail else str(error))[:200]})"


def _name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _user(uid: int) -> str:
    name = _name(uid)
    return f"uid {uid}" if name == str(uid) else f"{name} (uid {uid})"
