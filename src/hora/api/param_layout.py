"""Whether every rank passed ``broadcast_parameters`` the same model, and which parameters differ if not.

``broadcast_parameters`` packs the tensors into one buffer per dtype, so a model built differently on two ranks
would surface as a packed ``shape=[90]`` against ``[81]``, naming nothing the user wrote. Before packing, every
rank allgathers an 8-byte :func:`fingerprint` of its :func:`layout` (each tensor's dtype, device type and
shape, in the order the buffers take them; names left out, since a DDP-wrapped copy's ``module.`` prefix is
harmless). Only when the fingerprints differ do the ranks exchange their full layouts, and every rank raises
the same :class:`~hora.errors.ModelMismatchError` with :func:`describe_mismatch`'s message, naming the
parameters whose shapes differ. This module is the pure part; the collectives are in :mod:`hora.api.functions`.

Example:
    >>> print(describe_mismatch({0: [("fc.weight", "float32", (10, 8))], 1: [("fc.weight", "float32", (10, 9))]}, 0))
    broadcast_parameters: the model differs across ranks, so rank 0's parameters cannot be copied to the others.
      rank 1: 'fc.weight' has shape [10, 9] here, [10, 8] on rank 0
    The model is built differently on the ranks: ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

Entry = tuple[str, str, tuple[int, ...]]  # name, dtype (with the device type when not cpu), shape
SHOWN = 8  # differences listed per group of ranks; the rest are counted

FIX = ("The model is built differently on the ranks: something its construction depends on (a size computed "
       "from data or files, an argument or environment variable that differs by rank, a layer added only on some "
       "ranks) must be the same on every rank. Build the model identically everywhere, then broadcast.")


def layout(named: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    """What must agree across ranks, per tensor, in the order given."""
    out = []
    for name, t in named:
        kind = str(t.dtype).removeprefix("torch.")
        out.append((name, kind if t.device.type == "cpu" else f"{kind} on {t.device.type}", tuple(t.shape)))
    return out


def fingerprint(entries: Sequence[Entry]) -> int:
    digest = hashlib.blake2b(repr([(kind, shape) for _, kind, shape in entries]).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _shape(shape: tuple[int, ...]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _differences(theirs: list[Entry], root: list[Entry], root_rank: int) -> list[str]:
    """What differs between one rank's layout and the root's, by name where the names match, else by position."""
    by_name = {n: (k, s) for n, k, s in theirs}
    root_by_name = {n: (k, s) for n, k, s in root}
    out: list[str] = []
    if by_name.keys() & root_by_name.keys():
        for name, (kind, shape) in by_name.items():
            if name not in root_by_name:
                out.append(f"{name!r} ({_shape(shape)}) is not in rank {root_rank}'s model")
            elif root_by_name[name] != (kind, shape):
                rkind, rshape = root_by_name[name]
                what = "shape" if shape != rshape else "dtype"
                out.append(f"{name!r} has {what} {_shape(shape) if what == 'shape' else kind} here, "
                           f"{_shape(rshape) if what == 'shape' else rkind} on rank {root_rank}")
        out += [f"{name!r} ({_shape(s)}) of rank {root_rank}'s model is missing here"
                for name, (_, s) in root_by_name.items() if name not in by_name]
        return out
    for i, ((name, kind, shape), (rname, rkind, rshape)) in enumerate(zip(theirs, root)):
        if (kind, shape) != (rkind, rshape):
            label = repr(name) if name == rname else f"{name!r} (rank {root_rank}: {rname!r})"
            out.append(f"tensor #{i} {label} is {_shape(shape)} {kind} here, {_shape(rshape)} {rkind} on rank "
                       f"{root_rank}")
    if len(theirs) != len(root):
        out.append(f"{len(theirs)} tensors here, {len(root)} on rank {root_rank}")
    return out


def describe_mismatch(layouts: dict[int, list[Entry]], root_rank: int) -> str:
    """The message every rank raises: per group of ranks with the same layout, what differs from the root's."""
    root = layouts[root_rank]
    groups: dict[tuple[Entry, ...], list[int]] = {}
    for rank, entries in sorted(layouts.items()):
        if rank != root_rank and entries != root:
            groups.setdefault(tuple(entries), []).append(rank)
    lines = []
    for shared, ranks in groups.items():
        diffs = _differences(list(shared), root, root_rank) or [f"the tensors' order differs from rank "
                                                                 f"{root_rank}'s"]
        more = f"; and {len(diffs) - SHOWN} more" if len(diffs) > SHOWN else ""
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"  {who}: " + "; ".join(diffs[:SHOWN]) + more)
    return (f"broadcast_parameters: the model differs across ranks, so rank {root_rank}'s parameters cannot be "
            f"copied to the others.\n" + "\n".join(lines) + "\n" + FIX)
