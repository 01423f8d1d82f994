"""The hierarchical allreduce's intra-host steps through shared memory: each rank of a host owns 1/p of every
chunk, sums it from its host peers' shared buffers, allreduces that shard across hosts with the ranks of the
same local index (one cross-host group per local index), and the host's ranks copy every owner's result back.

Compared with reducing to one leader and broadcasting over loopback TCP, no intra-host byte goes through a
socket (the p ranks read each other's memory), and the cross-host traffic and the summing are spread over the
host's p ranks instead of resting on one. Every host's cable still carries ``2(h-1)/h S`` each way.

Each rank maps one segment of :data:`SLOTS` slots of :data:`SLOT_BYTES` (in ``/dev/shm``, reserved with
``posix_fallocate`` so a full tmpfs fails at ``init()``, never with SIGBUS later). A chunk goes through a slot:

1. *in*: each rank copies the shards it does not own into its slot; a barrier on the host's group;
2. *sum*: the owner of shard i adds its own data and its peers' copies into its slot's shard i, and issues the
   cross-host allreduce of that shard (asynchronous: up to :data:`SLOTS` chunks are on the wire);
3. *out*: once its allreduce is done, a barrier; every rank copies every owner's shard into the tensor; a
   barrier (issued, waited for when the slot is next used) frees the slot.

Every rank of a host runs the same schedule, so the barriers line up; every rank of a cross group issues its
allreduces in chunk order.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hora.datapath import c10d as dataplane

log = logging.getLogger(__name__)

__all__ = ["SLOTS", "SLOT_BYTES", "HostBuffers", "allreduce", "setup"]

SLOT_BYTES = 16 * 2**20  # the largest chunk
SLOTS = 3  # chunks in flight at once
CHUNK_BYTES = 4 * 2**20  # the smallest chunk of a pipelined allreduce
MAX_CHUNKS = 8  # a tensor is cut in up to this many chunks, unless they would exceed SLOT_BYTES
SHM_DIR = "/dev/shm"


@dataclass(eq=False)
class HostBuffers:
    """The segments of this host's ranks (this rank's at ``index``), mapped in this process."""

    segments: list[torch.Tensor]  # uint8, ``slots * slot_bytes`` each, in local-rank order
    index: int
    slot_bytes: int = SLOT_BYTES
    slots: int = SLOTS
    freed: list[Any] = field(default_factory=list)  # per slot: the barrier after which it is reusable

    def __post_init__(self) -> None:
        self.freed = [None] * self.slots

    def slot(self, owner: int, slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.segments[owner][start : start + self.slot_bytes].view(dtype)[:numel]


def _create(nbytes: int) -> tuple[str, torch.Tensor] | None:
    """A new shared segment of ``nbytes`` (path, mapping), or None where /dev/shm cannot hold it."""
    if not os.path.isdir(SHM_DIR):
        return None
    fd, path = tempfile.mkstemp(prefix="hora-hier-", dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        log.warning("hierarchical allreduce: no %d MB shared segment in %s (%s): the host's ranks reduce over "
                    "loopback instead", nbytes >> 20, SHM_DIR, e)
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _map(path: str, nbytes: int) -> torch.Tensor | None:
    """A host peer's segment, mapped here; None where the path is not there (``torch.from_file`` would create
    a file of its own, shared with nobody)."""
    if not os.path.isfile(path) or os.path.getsize(path) != nbytes:
        return None
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def setup(local_group: Any, index: int, flat_group: Any) -> HostBuffers | None:
    """Create this rank's segment and map its host peers'. Collective on the flat group (every rank calls it,
    at init): returns None on every rank if any rank failed, so every host takes the same path.

    Each rank writes a random token at the start of its segment and sends it with the path; a peer that reads
    another token there (the "same host" has separate /dev/shm, as in two containers) counts as a failure."""
    nbytes = SLOTS * SLOT_BYTES
    created = _create(nbytes)
    token = int.from_bytes(os.urandom(8), "little") >> 1  # fits an int64
    if created is not None:
        created[1][:8].view(torch.int64).fill_(token)
    offers: list[tuple[str, int] | None] = [None] * dist.get_world_size(local_group)
    dist.all_gather_object(offers, (created[0], token) if created else None, group=local_group)
    segments: list[torch.Tensor] = []
    try:
        for i, offer in enumerate(offers):
            mapped = created[1] if i == index and created is not None else _map(offer[0], nbytes) if offer else None
            if mapped is None or offer is None or int(mapped[:8].view(torch.int64).item()) != offer[1]:
                log.warning("hierarchical allreduce: local rank %d's shared segment is not visible here: the "
                            "hosts reduce-scatter and allgather through Gloo instead", i)
                break
            segments.append(mapped)
    except (OSError, RuntimeError) as e:
        log.warning("hierarchical allreduce: cannot map a host peer's shared segment (%s)", e)
    ok = torch.tensor([int(len(segments) == len(offers))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=flat_group)  # also: every peer has mapped my segment
    if created is not None:
        os.unlink(created[0])  # the mappings stay; from here on nothing is left in /dev/shm, even after a crash
    return HostBuffers(segments, index, SLOT_BYTES, SLOTS) if int(ok.item()) == 1 else None


def chunk_bounds(numel: int, element_size: int, slot_bytes: int = SLOT_BYTES) -> list[int]:
    """Where the chunks start, then ``numel``: up to :data:`MAX_CHUNKS` chunks of at least :data:`CHUNK_BYTES`,
    none above a slot. Decided from the tensor's size alone, so every rank cuts it the same way.

    >>> chunk_bounds(10, 4)
    [0, 10]
    >>> [b >> 20 for b in chunk_bounds(32 * 2**20, 4)]
    [0, 4, 8, 12, 16, 20, 24, 28, 32]
    >>> len(chunk_bounds(2**30, 4)) - 1  # 4 GB: 256 chunks of a slot (16 MB) each
    256
    """
    per = max(-(-numel // MAX_CHUNKS), CHUNK_BYTES // element_size)
    step = max(1, min(per, slot_bytes // element_size, numel))
    return [*range(0, numel, step), numel]


# The copies and sums run single-threaded in numpy (which lets go of the GIL meanwhile), not as torch ops:
# torch's would run on its intra-op (OpenMP) threads, and with several ranks per host those threads
# oversubscribe the cores and spin at their barriers (docs/performance.md, "The measurements behind design choices").
# float16 and bfloat16 sums, which numpy lacks or does slowly, stay with torch.
_NUMPY_SUMS = {torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
_UFUNCS: dict[str, Any] = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
_TORCH_FNS: dict[str, Any] = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for flat contiguous tensors of one dtype, as bytes, on this thread alone."""
    np.copyto(_np(dst.view(torch.uint8)), _np(src.view(torch.uint8)))


def _np(t: torch.Tensor) -> Any:
    return t.detach().numpy()


def _op_name(op: int) -> str:
    wire = dataplane.wire_op(op)
    return ("sum" if wire == dist.ReduceOp.SUM else "min" if wire == dist.ReduceOp.MIN
            else "max" if wire == dist.ReduceOp.MAX else "product")


def _combine(op: int, out: torch.Tensor, first: torch.Tensor, rest: list[torch.Tensor]) -> None:
    """``out = first (op) rest[0] (op) ...`` for the reduce op carried on the wire."""
    if not rest:
        _copy(out, first)
        return
    name = _op_name(op)
    if out.dtype in _NUMPY_SUMS:
        ufunc = _UFUNCS[name]
        ufunc(_np(first), _np(rest[0]), out=_np(out))
        for other in rest[1:]:
            ufunc(_np(out), _np(other), out=_np(out))
        return
    fn = _TORCH_FNS[name]
    fn(first, rest[0], out=out)
    for other in rest[1:]:
        fn(out, other, out=out)


def allreduce(buf: HostBuffers, tensor: torch.Tensor, op: int, local_group: Any, cross_group: Any) -> None:
    """Allreduce the contiguous CPU ``tensor`` in place, on the calling thread (the schedule in the module's
    docstring); returns when the result is in ``tensor``."""
    flat = tensor.view(-1)
    numel, p, me = flat.numel(), len(buf.segments), buf.index
    if numel == 0:
        return
    bounds = chunk_bounds(numel, flat.element_size(), buf.slot_bytes)
    n, slots = len(bounds) - 1, buf.slots
    crossing: dict[int, Any] = {}
    arrived: dict[int, Any] = {}

    def shards(owner: int, k: int) -> list[torch.Tensor]:
        return list(buf.slot(owner, k % slots, flat.dtype, bounds[k + 1] - bounds[k]).tensor_split(p))

    def mine(k: int) -> list[torch.Tensor]:
        return list(flat[bounds[k] : bounds[k + 1]].tensor_split(p))

    def stage_in(k: int) -> None:
        freed = buf.freed[k % slots]
        if freed is not None:
            freed.wait()  # every rank has copied the slot's previous chunk out
        for i, (dst, src) in enumerate(zip(shards(me, k), mine(k))):
            if i != me:
                _copy(dst, src)
        arrived[k] = dataplane.barrier(local_group)

    def stage_sum(k: int) -> None:
        arrived.pop(k).wait()
        out = shards(me, k)[me]
        _combine(op, out, mine(k)[me], [shards(i, k)[me] for i in range(p) if i != me])
        if out.numel():  # the same size on every rank of the cross group
            crossing[k] = dataplane.allreduce(out, op, cross_group)

    def stage_out(k: int) -> None:
        work = crossing.pop(k, None)
        if work is not None:
            work.wait()
        dataplane.barrier(local_group).wait()  # every owner's shard of chunk k is final
        dst = mine(k)
        for i in range(p):
            _copy(dst[i], shards(i, k)[i])
        buf.freed[k % slots] = dataplane.barrier(local_group)

    for k in range(n):
        if k >= slots:
            stage_out(k - slots)
        stage_in(k)
        stage_sum(k)
    for k in range(max(0, n - slots), n):
        stage_out(k)
