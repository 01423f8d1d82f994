"""Hierarchical allreduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``): reduce within each host, allreduce
across hosts, then share the result within the host.

Three ways, chosen once at ``init()`` and the same on every rank:

* ``"shard"`` (every host runs the same number p of ranks; NCCL, or Gloo where shared memory is not
  available), as Horovod 0.28.1's ``NCCLHierarchicalAllreduce`` does it (horovod/common/ops/
  nccl_operations.cc:405-556): a reduce-scatter within the host leaves local rank i the host's sum of
  shard i (``n // p`` elements); every local rank allreduces its shard across hosts with the ranks of the
  same local index (p cross-host groups, all busy at once); an allgather within the host gives every rank
  every shard. The ``n % p`` elements left over are reduced to the host's last local rank, which allreduces
  them with its shard (they follow it in memory) and broadcasts them back. On 8-GPU nodes with a NIC per GPU
  the cross-host step uses all eight;
* ``"shm"`` (the same steps for Gloo on equal hosts, when /dev/shm can hold each rank's buffers): the
  host's reduce-scatter and allgather go through shared memory, not sockets (:mod:`hora.datapath.shared_memory`);
* ``"leader"`` (hosts with unequal rank counts, where a shard per local rank is not defined; Horovod's
  non-homogeneous case): reduce to the host's *leader* (its lowest rank), allreduce among the leaders,
  broadcast within the host.

With several ranks per host, the flat ring sends ``2(n-1)/n`` of the data over every host's network link for
``n`` ranks; the hierarchy sends ``2(h-1)/h`` for ``h`` hosts, and the intra-host steps stay on the host
(NVLink, shared memory, loopback). That is a win only where the network is the limit and several ranks share
a host; with one rank per host it is the flat ring (hora then skips the hierarchy altogether).

Only collectives on the global process set take this path (as in Horovod): ``hvd.allreduce`` and the
DistributedOptimizer's gradient buckets, fused or not. The groups are built once at ``init()`` when the knob
is on, by every rank in the same order (``dist.new_group`` is collective): one per host with several ranks,
and one cross-host group per local index on equal hosts (the leaders' only on unequal ones), each used.

Every way runs as a pipeline over chunks, so the intra-host steps hide behind the network, and in place: no
buffer is allocated per call (NCCL and Gloo both take a reduce-scatter whose output is the rank's own slice
of its input, and an allgather whose input is its slice of the output).

Example:
    HOROVOD_HIERARCHICAL_ALLREDUCE=1 hora run -np 16 -H a:8,b:8 python train.py
    hora run --hierarchical-allreduce -np 6 -H a:2,b:2,c:2 python train.py
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hora.datapath import c10d as dataplane
from hora.datapath import shared_memory as hostshm

log = logging.getLogger(__name__)

__all__ = ["MODES", "Hierarchy", "allreduce", "build", "flat"]

MODES = ("shard", "shm", "leader")


@dataclass(eq=False)
class Hierarchy:
    """This rank's groups for the three steps, and which global group they stand in for."""

    flat_group: Any  # the global process set's group: only its allreduces go hierarchical
    local_group: Any  # the ranks on this rank's host (None when this host runs one rank)
    cross_group: Any  # the ranks of this rank's local index on every host (index 0: the leaders); None on a
    # rank that is not its host's leader when the hosts run unequal numbers of ranks
    leader: int  # global rank of this host's leader (its first rank)
    rank: int
    hosts: tuple[tuple[int, ...], ...]
    shared: hostshm.HostBuffers | None = None  # the host's shared buffers (None: not the shared-memory way)
    mode: str = "leader"  # one of MODES; a benchmark or test may switch an "shm" hierarchy to "shard" or
    # "leader", or a "shard" one to "leader" (every rank at the same point of its sequence of collectives)
    calls: int = 0  # allreduces that took the three steps (diagnostics, tests)
    enabled: bool = True  # False: built but off (autotune switches it, every rank at the same round)

    @property
    def host(self) -> tuple[int, ...]:
        """The global ranks on this rank's host, in local-rank order."""
        return next(h for h in self.hosts if self.rank in h)


class _ChainWork:
    """The Works of the last step (one or two per chunk); the earlier steps were issued before them."""

    __slots__ = ("_works",)

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> Any:
        return torch.futures.collect_all([work.get_future() for work in self._works])


def worthwhile(hosts: Sequence[Sequence[int]]) -> bool:
    """True when the hierarchy can save network traffic: several hosts and some host with several ranks."""
    return len(hosts) > 1 and any(len(h) > 1 for h in hosts)


def build(hosts: tuple[tuple[int, ...], ...], rank: int, flat_group: Any, backend: str,
          new_group: Callable[[Sequence[int]], Any]) -> Hierarchy | None:
    """Create the groups with ``new_group`` (every rank calls this with the same ``hosts``); the runtime holds
    the hierarchy and hands it to the engine (``EngineContext.hierarchy``), which gives it to each allreduce.

    Returns None, leaving allreduce flat, when the layout gains nothing (one host, or one rank per host).
    """
    if not worthwhile(hosts):
        log.info("hierarchical allreduce requested, but the layout %s gains nothing: allreduce stays flat",
                 [len(h) for h in hosts])
        return None
    local_group = None
    for members in hosts:  # every rank creates every group, in the same order
        group = new_group(members) if len(members) > 1 else None
        if rank in members:
            local_group = group
    mine = next(h for h in hosts if rank in h)
    even = len({len(h) for h in hosts}) == 1
    cross_group = None
    for index in range(len(mine) if even else 1):  # one cross-host group per local index (index 0: the leaders)
        group = new_group([h[index] for h in hosts])
        if mine[index] == rank:
            cross_group = group
    shared = hostshm.setup(local_group, mine.index(rank), flat_group) if even and backend == "gloo" else None
    mode = "shm" if shared is not None else "shard" if even else "leader"
    built = Hierarchy(flat_group=flat_group, local_group=local_group, cross_group=cross_group, leader=mine[0],
                        rank=rank, hosts=hosts, shared=shared, mode=mode)
    log.info("hierarchical allreduce on (%s): %d hosts, ranks per host %s", mode, len(hosts), [len(h) for h in hosts])
    return built


@contextlib.contextmanager
def flat(h: Hierarchy | None) -> Iterator[None]:
    """Allreduce flat inside the block even with the hierarchy ``h`` on, so a benchmark can time both paths in
    one run. Every rank must enter and leave it at the same point of its sequence of collectives."""
    if h is None:
        yield
        return
    saved, h.enabled = h.enabled, False
    try:
        yield
    finally:
        h.enabled = saved


def chunks_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The pipeline's pieces: 4 MB or more each, at most :data:`MAX_CHUNKS`.

    >>> [c.numel() for c in chunks_of(torch.zeros(10))]
    [10]
    >>> len(chunks_of(torch.zeros(64 * 2**20 // 4)))
    8
    """
    flat = tensor.view(-1)
    return [flat[a:b] for a, b in dataplane.pieces(flat.numel(), flat.element_size(), CHUNK_BYTES, MAX_CHUNKS)]


CHUNK_BYTES = 4 * 2**20
MAX_CHUNKS = 8


def allreduce(tensor: torch.Tensor, op: int, group: Any, h: Hierarchy | None) -> Any:
    """Allreduce ``tensor`` in place on ``group`` and return a Work: in three steps when ``group`` is the global
    process set's and the hierarchy ``h`` is on, else as one flat c10d allreduce. The only place either path is
    chosen (single ops, fused batches and gradient buckets all come here, when a hierarchy was built).

    Every rank issues the same ops on each group in the same order. A step that needs an earlier one's result
    waits for its Work on the calling thread first: on NCCL that only orders the launch stream after it (the
    host does not block), on Gloo it blocks the round's thread, while the ops already issued run.
    """
    if h is None or not h.enabled or group is not h.flat_group:
        return dataplane.allreduce(tensor, op, group)
    h.calls += 1
    if h.mode == "shm" and h.shared is not None and tensor.device.type == "cpu":
        try:
            hostshm.allreduce(h.shared, tensor, op, h.local_group, h.cross_group)
        except Exception as e:  # noqa: BLE001 - a peer lost mid-way (Gloo's error): reported at wait()
            return dataplane.done_work(e)
        return dataplane.done_work()
    if h.mode in ("shm", "shard"):
        return _sharded(h, chunks_of(tensor), op)
    return _through_leaders(h, chunks_of(tensor), op)


def _sharded(h: Hierarchy, chunks: list[torch.Tensor], op: int) -> _ChainWork:
    """The ``"shard"`` way, chunk by chunk: while local rank i's shard of chunk k crosses the hosts, the host
    reduce-scatters chunk k+1; the allgathers follow their cross-host allreduces."""
    host = h.host
    p, me, last = len(host), host.index(h.rank), host[-1]  # the last local rank also takes the remainder
    local, cross = h.local_group, h.cross_group
    per = [c.numel() // p for c in chunks]
    summed = []
    for c, n in zip(chunks, per):  # 1. within the host: shard i summed on local rank i, the remainder on the last
        works = [dataplane.reduce_scatter(c[me * n : (me + 1) * n], c[: n * p], op, local)] if n else []
        if c.numel() > n * p:
            works.append(dataplane.reduce(c[n * p :], last, op, local))
        summed.append(works)
    crossing = []
    for c, n, works in zip(chunks, per, summed):  # 2. across hosts, each local rank its shard (the last: and the rest)
        for work in works:
            work.wait()
        own = c[me * n :] if me == p - 1 else c[me * n : (me + 1) * n]
        crossing.append(dataplane.allreduce(own, op, cross) if own.numel() else None)
    shared = []
    for c, n, work in zip(chunks, per, crossing):  # 3. within the host: every shard, the remainder from the last
        if work is not None:
            work.wait()
        if n:
            shared.append(dataplane.gather(c[: n * p], c[me * n : (me + 1) * n], local))
        if c.numel() > n * p:
            shared.append(dataplane.broadcast(c[n * p :], last, local))
    return _ChainWork(shared)


def _through_leaders(h: Hierarchy, chunks: list[torch.Tensor], op: int) -> _ChainWork:
    """The ``"leader"`` way: while the leaders allreduce chunk k across hosts, the host reduces chunk k+1 and
    broadcasts chunk k-1; a leader issues chunk k's broadcast once its cross-host allreduce is done."""
    local, cross = h.local_group, (h.cross_group if h.rank == h.leader else None)
    reduces = [dataplane.reduce(c, h.leader, op, local) for c in chunks] if local is not None else []
    crossing = []
    if cross is not None:
        for i, c in enumerate(chunks):
            if reduces:
                reduces[i].wait()
            crossing.append(dataplane.allreduce(c, op, cross))
    if local is None:
        return _ChainWork(crossing)
    broadcasts = []
    for i, c in enumerate(chunks):
        if crossing:
            crossing[i].wait()
        broadcasts.append(dataplane.broadcast(c, h.leader, local))
    return _ChainWork(broadcasts)
