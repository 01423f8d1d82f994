"""The Adasum kind (``allreduce(op=hvd.Adasum)``): the combination, its vector halving and distance doubling,
and the kind's steps (:class:`Adasum`).

Adasum (Maleki et al., 2020): combine gradients so that orthogonal ones add and parallel ones average.

For two vectors::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with the dot product and the squared norms in float64, whatever the tensors' dtype. A coefficient stays 1 when
its vector's squared norm is below ``sqrt(DBL_MIN)`` (about 1.5e-154), Horovod 0.28.1's threshold: the pair is
then summed. Only float64 vectors whose values are all below about 1e-77 (or zero) fall under it: the
smallest normal float16, bfloat16 and float32 numbers square to far more. Over ``2^k`` ranks the pairs
combine as a binary tree: ranks differing in bit 0 first, then in bit 1, and so on.

``hvd.allreduce(t, op=hvd.Adasum)`` (:class:`Adasum`) runs it as Horovod 0.28.1 does
(horovod/common/ops/adasum/adasum.h, ``FusedAllreduce``): vector halving, distance doubling (:func:`vhdd`).
At level ``L = 1, 2, 4, ...`` each rank swaps half of the part it holds with rank ``r ^ L`` and combines
the half it keeps, the dot product and norms of the two whole vectors summed over the ``2L`` ranks that hold
their parts; then the parts travel back, distance halving. Every rank holds at most half the tensor more
than its own, never every rank's copy. On CUDA tensors of the global set the first ``log2(ranks per host)``
levels *sum* instead, so a host's ranks add their tensors and the hosts' sums are combined by Adasum, and
the result is divided by the ranks per host: Horovod's GPU Adasum (horovod/common/ops/
adasum_gpu_operations.cc: a NCCL reduce-scatter within the node, Adasum from ``start_level = local_size``
across nodes, an allgather; common/operations.cc:1459-1465: ``postscale_factor /= local_size``), which
needs every host to run the same number of ranks, numbered host by host.

Example:
    >>> import torch
    >>> adasum_pair(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    tensor([1., 1.])
    >>> adasum_pair(torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0]))
    tensor([2., 0.])
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from hora.datapath import c10d as dataplane
from hora.datapath import streams
from hora.datapath.c10d import Work
from hora.datapath.kinds.op import Op, Peers
from hora.datapath.wire import copy_out, to_wire
from hora.errors import UnsupportedCallError

# Horovod 0.28.1 (common/ops/adasum/adasum.h) skips the rescaling of a vector whose squared norm is below the
# square root of the smallest normal double: below it, the dot product over the squared norm is not trusted.
_NORM_EPS = math.sqrt(sys.float_info.min)

_hosts: tuple[tuple[int, ...], ...] = ()  # the global ranks on each host, set at init()


def set_hosts(hosts: tuple[tuple[int, ...], ...]) -> None:
    """Where every rank runs (``hvd.init()``; ``()`` at shutdown): GPU Adasum sums within a host."""
    global _hosts
    _hosts = hosts


def _coefficients(dot: torch.Tensor, anorm: torch.Tensor, bnorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two vectors' factors, as tensors on their device (no host synchronisation)."""
    one = torch.ones_like(dot)
    return (torch.where(anorm >= _NORM_EPS, 1.0 - dot / (2.0 * anorm), one),
            torch.where(bnorm >= _NORM_EPS, 1.0 - dot / (2.0 * bnorm), one))


_PIECE = 1 << 20  # elements widened to float64 at a time: the arithmetic's memory stays small and fixed


def _pieces(n: int) -> range:
    return range(0, n, _PIECE)


def _dot_and_norms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[a.b, |a|^2, |b|^2]`` in float64, a piece at a time."""
    a, b = a.reshape(-1), b.reshape(-1)
    total = torch.zeros(3, dtype=torch.float64, device=a.device)
    for start in _pieces(a.numel()):
        a64, b64 = a[start : start + _PIECE].double(), b[start : start + _PIECE].double()
        total += torch.stack([torch.dot(a64, b64), torch.dot(a64, a64), torch.dot(b64, b64)])
    return total


def _combine_into(a: torch.Tensor, acoeff: torch.Tensor, b: torch.Tensor, bcoeff: torch.Tensor) -> None:
    """``a = acoeff a + bcoeff b``, in float64 a piece at a time (Horovod's ScaledAdd)."""
    for start in _pieces(a.numel()):
        piece = a[start : start + _PIECE]
        piece.copy_(acoeff * piece.double() + bcoeff * b[start : start + _PIECE].double())


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors (the dot product and squared norms in float64, Horovod's threshold)."""
    dot, anorm, bnorm = _dot_and_norms(a, b)
    acoeff, bcoeff = _coefficients(dot, anorm, bnorm)
    out = a.clone()
    _combine_into(out, acoeff, b, bcoeff)
    return out


def adasum_tree(rows: torch.Tensor) -> torch.Tensor:
    """Adasum of the rows of ``rows`` (shape ``(2^k, n)``), paired as a binary tree: the reference
    :func:`vhdd` computes without gathering the rows."""
    count = rows.shape[0]
    if count & (count - 1):
        raise UnsupportedCallError(f"Adasum needs a power-of-two number of ranks, got {count}")
    level = list(rows)
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def summed_levels(members: Sequence[int], cuda: bool) -> int:
    """How many of :func:`vhdd`'s first levels sum: ``log2(ranks per host)`` for CUDA tensors on every rank of
    the job (Horovod's GPU Adasum), else 0.

    Raises:
        UnsupportedCallError: CUDA tensors on every rank, but hosts with different numbers of ranks, or ranks
            not numbered host by host (Horovod refuses the first: "Running GPU Adasum on heterogeneous
            cluster is not supported yet").
    """
    world = sum(len(h) for h in _hosts)
    if not cuda or len(_hosts) == 0 or list(members) != list(range(world)):
        return 0
    per_host = len(_hosts[0])
    if any(h != tuple(range(i * per_host, (i + 1) * per_host)) for i, h in enumerate(_hosts)):
        raise UnsupportedCallError(
            "GPU Adasum sums within each host and combines the hosts' sums (as Horovod's): it needs every host "
            f"to run the same number of ranks, numbered host by host; this job's hosts run ranks "
            f"{[list(h) for h in _hosts]}. Use op=hvd.Average, or Adasum on CPU tensors")
    return per_host.bit_length() - 1  # members is a power of two (checked at submit), so per_host is too


def vhdd(flat: torch.Tensor, members: Sequence[int], rank: int, group: Any, summed: int = 0) -> None:
    """Replace ``flat`` (1-D, contiguous) by the Adasum of every member's ``flat``, in place, on every member:
    vector halving, distance doubling (the module's docstring); the first ``summed`` levels sum. Issues
    point-to-point exchanges and, per combining level, one allgather of three doubles per member on
    ``group``, every member in the same order. Returns once all is issued; on CUDA what follows on the current
    stream is ordered after it (each step's Work was waited for), on Gloo it is done."""
    n, i = len(members), list(members).index(rank)
    spare = torch.empty(flat.numel() - flat.numel() // 2, dtype=flat.dtype, device=flat.device)
    table = torch.empty((n, 3), dtype=torch.float64, device=flat.device)
    lo, hi = 0, flat.numel()
    spans = []
    for k in range(n.bit_length() - 1):
        level, lower = 1 << k, not i & (1 << k)
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        mine, theirs = flat[keep[0] : keep[1]], spare[: keep[1] - keep[0]]
        _wait(dataplane.exchange(flat[give[0] : give[1]], theirs, members[i ^ level], group))
        spans.append((lo, hi))
        lo, hi = keep
        if k < summed:
            mine.add_(theirs)
            continue
        a, b = (mine, theirs) if lower else (theirs, mine)  # a: the lower half-block's vector
        _wait([dataplane.gather(table.view(-1), _dot_and_norms(a, b), group)])
        first = (i >> (k + 1)) << (k + 1)  # the 2L members holding the parts of these two vectors
        dot, anorm, bnorm = table[first : first + 2 * level].sum(0)
        acoeff, bcoeff = _coefficients(dot, anorm, bnorm)
        _combine_into(mine, *((acoeff, theirs, bcoeff) if lower else (bcoeff, theirs, acoeff)))
    for k in reversed(range(len(spans))):
        whole = spans[k]
        other = (hi, whole[1]) if lo == whole[0] else (whole[0], lo)
        _wait(dataplane.exchange(flat[lo:hi], flat[other[0] : other[1]], members[i ^ (1 << k)], group))
        lo, hi = whole


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


class Adasum:
    """The steps of ``allreduce(op=hvd.Adasum)``: the members combine their flattened tensors in place by
    :func:`vhdd`, as Horovod does; on CUDA tensors of the whole job a host's ranks average theirs first
    (Horovod's GPU Adasum: summed, then divided by the ranks per host). Runs entirely at launch, in the agreed
    order; ``op.ctx``: the summed levels."""

    @staticmethod
    def prepare(op: Op) -> None:
        call = op.call
        flat = call.tensor.detach().reshape(-1)
        if call.prescale != 1.0:
            flat = flat * call.prescale
        op.wire = to_wire(flat, copy=not call.inplace and call.prescale == 1.0)  # combined in place

    @staticmethod
    def launch(op: Op, peers: Peers) -> Work:
        ranks = peers.agreed.ps
        cuda = op.wire.is_cuda
        try:
            op.ctx = summed = summed_levels(ranks, cuda)
            vhdd(op.wire, ranks, peers.rank, peers.group, summed)
        except Exception as e:  # noqa: BLE001 - a peer lost mid-way (the backend's error): reported at wait()
            return dataplane.done_work(e)
        # on CUDA every step was issued on the launch stream, which each step's Work was waited on
        return streams.EventWork(torch.cuda.current_stream(op.wire.device)) if cuda else dataplane.done_work()

    @staticmethod
    def launch_joined(peers: Peers) -> None:
        return None  # never runs: the negotiation table fails Adasum while a rank has joined (table.JOIN_OK)

    @staticmethod
    def finish(op: Op) -> torch.Tensor:
        call = op.call
        result = op.wire.view(call.tensor.shape)
        if op.ctx:  # a host's ranks were summed: Horovod divides by the ranks per host (its postscale)
            result.div_(1 << op.ctx) if result.is_floating_point() else result.floor_divide_(1 << op.ctx)
        if result.dtype != call.tensor.dtype:
            result = result.to(call.tensor.dtype)
        if call.postscale != 1.0:
            result.mul_(call.postscale)
        return copy_out(result, call.tensor, call.inplace)
