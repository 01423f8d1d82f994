"""Hierarchical allreduce gives the flat ring's results: plain and fused allreduces, every reduce op, a joined
rank's zeros, and the DistributedOptimizer's buckets, on fork-started ranks that claim to live on several
hosts (``HORA_HOST_KEY``), so the runtime builds the per-host and cross-host groups for real. Every way: the
shared-memory one (equal hosts) with small slots, so a tensor runs through many chunks and reuses every slot;
the shard one (Horovod's NCCL way: reduce-scatter within the host, each local rank's shard across hosts,
allgather; equal hosts without shared memory, or switched to), bit for bit the flat allreduce; and the leader
one (unequal hosts, or switched to on equal hosts)."""

from __future__ import annotations

import os
import threading
import time

import torch

import hora as hvd
from hora.datapath import hierarchical
from hora.datapath import shared_memory as hostshm
from hora.runtime import lifecycle as runtime
from tests.distributed.expect import close, rank_input, reduce
from tests.distributed.harness import as_host, run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _train_steps(rank: int) -> list[list[float]]:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(8, 40), torch.randint(0, 3, (8,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]  # plain lists cross the pipe


def _more_callers(rank: int, size: int) -> int:
    """In-place, several in flight, sizes not divisible by the ranks per host (one element: some shards
    empty), integers, a product, and a compressed (16-bit, in pieces) allreduce: exact against the flat sums."""
    total = float(sum(range(size)))
    handles = [hvd.allreduce_async_(torch.full((n,), float(rank)), op=hvd.Sum, name=f"inflight.{n}")
               for n in (1, 3, 70_001, 250_003)]
    outs = [hvd.synchronize(hd) for hd in handles]
    for out in outs:
        close(out, torch.full_like(out, total), f"in flight, {out.numel()} elements")
    t = torch.arange(100_003, dtype=torch.int64) + rank
    hvd.allreduce_(t, op=hvd.Sum)
    close(t, torch.arange(100_003, dtype=torch.int64) * size + int(total), "in place, int64")
    prod = hvd.allreduce(torch.full((33_333,), 1.0 + rank / 8), op=hvd.Product)
    expect = torch.full((33_333,), 1.0)
    for r in range(size):
        expect *= 1.0 + r / 8
    close(prod, expect, "product")
    big = (torch.arange(3 * 2**20, dtype=torch.float32) % 256) + rank  # 4 MiB of fp16 on the wire: pieces
    half = hvd.allreduce(big, op=hvd.Sum, compression=hvd.Compression.fp16)
    close(half, (torch.arange(3 * 2**20, dtype=torch.float32) % 256) * size + total, "fp16 compressed, pieces")
    return 7


def _ways_below(mode: str) -> list[str]:
    """The ways an hierarchy chosen as ``mode`` may be switched to: shared memory's groups serve the shard and
    leader ways, the shard way's the leader way."""
    return {"shm": ["shard", "leader"], "shard": ["leader"]}.get(mode, [])


def _same_as_flat(rank: int, size: int) -> int:
    """Sizes below, at and around multiples of the ranks per host, one and several chunks: bit for bit the flat
    allreduce of the same inputs in the same job (whole numbers: every order of summing gives the same
    floats), and the same on every rank."""
    checked = 0
    for n in (1, 2, 5, 64 * 1024 // 4 * 3 + 5, 200_003):
        g = torch.Generator().manual_seed(n + 7 * rank)
        x = torch.randint(-1000, 1000, (n,), generator=g).float()
        got = hvd.allreduce(x, op=hvd.Sum, name=f"way.{n}")
        with hierarchical.flat(runtime.hierarchy()):
            flat = hvd.allreduce(x, op=hvd.Sum, name=f"flat.{n}")
            every = hvd.allgather(got.unsqueeze(0), name=f"same.{n}")
        assert torch.equal(got, flat), f"{n} elements: {(got - flat).abs().max()} off the flat allreduce"
        assert all(torch.equal(every[0], row) for row in every), f"{n} elements: ranks got different sums"
        checked += 1
    return checked


def _private_segment(path: str, nbytes: int) -> torch.Tensor | None:
    """A segment of this rank's own instead of the peer's at ``path``."""
    made = hostshm._create(nbytes)
    assert made is not None
    os.unlink(made[0])
    return made[1]


def _hierarchical_job(rank: int, size: int, per_host: list[int], knob: str, train: bool,
                      no_shm_rank: int = -1, separate_shm_rank: int = -1) -> dict[str, object]:
    as_host(rank, per_host, knob)
    if rank == no_shm_rank:
        hostshm.SHM_DIR = "/nonexistent-shm"  # this rank cannot make its segment
    if rank == separate_shm_rank:  # this rank sees other files than its host peers (as in another container)
        hostshm._map = _private_segment
    hierarchical.CHUNK_BYTES = 64 * 1024  # pipeline the large allreduce below in 8 chunks
    hostshm.SLOT_BYTES, hostshm.CHUNK_BYTES = 64 * 1024, 16 * 1024  # 1.2 MB: 19 chunks through 3 slots
    hvd.init()
    try:
        h = runtime.hierarchy()
        checked = 0
        for dtype in (torch.float32, torch.int64):
            inputs = [rank_input(r, (7, 5), dtype) for r in range(size)]
            ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype.is_floating_point else [])
            for op in ops:
                out = hvd.allreduce(inputs[rank].clone(), op=op)
                close(out, reduce(inputs, op), f"hierarchical allreduce {dtype} {op}")
                checked += 1
        big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)  # above the fusion size limit
        close(hvd.allreduce(big, op=hvd.Sum), torch.arange(300_000, dtype=torch.float32) * (size * (size + 1) / 2),
              "a large allreduce")
        # several small ones ready together: fused into one buffer, then hierarchical
        parts = [torch.full((10 + i,), float(rank + i)) for i in range(5)]
        outs = hvd.grouped_allreduce(parts, op=hvd.Sum)
        for i, out in enumerate(outs):
            close(out, torch.full((10 + i,), float(sum(r + i for r in range(size)))), f"fused part {i}")
        checked += _more_callers(rank, size)
        chosen = h.mode if h is not None else "flat"
        for other in _ways_below(chosen):  # the other ways the same groups allow, then back
            h.mode = other  # type: ignore[union-attr]
            checked += _more_callers(rank, size)
            checked += _same_as_flat(rank, size)
        if h is not None:
            h.mode = chosen
        # a joined rank contributes zeros through the same three steps
        if rank != size - 1:
            close(hvd.allreduce(torch.ones(1000), op=hvd.Sum), torch.full((1000,), float(size - 1)),
                  "allreduce with the last rank joined")
        hvd.join()
        result: dict[str, object] = {"active": h is not None, "leader": h.leader if h else -1, "checked": checked,
                                     "mode": chosen}
        if train:
            result["hierarchical"] = _train_steps(rank)
            with hierarchical.flat(runtime.hierarchy()):  # the flat ring in the same job: the reference
                result["flat"] = _train_steps(rank)
        result["calls"] = h.calls if h else 0
        return result
    finally:
        hvd.shutdown()


def test_three_hosts_of_two_match_flat() -> None:
    out = run_ranks(_hierarchical_job, 6, [2, 2, 2], "1", True, init=False, timeout=120)
    assert [r["active"] for r in out] == [True] * 6
    assert [r["leader"] for r in out] == [0, 0, 2, 2, 4, 4]
    assert [r["mode"] for r in out] == ["shm"] * 6
    assert all(r["checked"] == 7 + 7 + 12 + 12 for r in out)  # shared memory, then the shard and leader ways
    assert all(int(r["calls"]) >= 10 for r in out)  # type: ignore[call-overload]  # the three steps ran
    for r in out:  # the same training as the flat ring, to rounding
        for p_h, p_f in zip(r["hierarchical"], r["flat"]):  # type: ignore[call-overload]
            torch.testing.assert_close(torch.tensor(p_h), torch.tensor(p_f), rtol=1e-5, atol=1e-6)


def test_two_hosts_of_three_share_memory() -> None:
    out = run_ranks(_hierarchical_job, 6, [3, 3], "1", False, init=False, timeout=120)
    assert [r["mode"] for r in out] == ["shm"] * 6
    assert [r["leader"] for r in out] == [0, 0, 0, 3, 3, 3]
    assert all(r["checked"] == 7 + 7 + 12 + 12 for r in out)


def test_a_rank_without_shared_memory_makes_every_host_take_the_shard_way() -> None:
    out = run_ranks(_hierarchical_job, 4, [2, 2], "1", True, 3, init=False, timeout=90)
    assert [r["mode"] for r in out] == ["shard"] * 4
    assert all(r["checked"] == 7 + 7 + 12 for r in out)  # the shard way, then the leader way
    for r in out:  # the same training as the flat ring, to rounding
        for p_h, p_f in zip(r["hierarchical"], r["flat"]):  # type: ignore[call-overload]
            torch.testing.assert_close(torch.tensor(p_h), torch.tensor(p_f), rtol=1e-5, atol=1e-6)


def test_a_rank_that_cannot_see_its_peers_segments_makes_every_host_take_the_shard_way() -> None:
    out = run_ranks(_hierarchical_job, 4, [2, 2], "1", False, -1, 2, init=False, timeout=90)
    assert [r["mode"] for r in out] == ["shard"] * 4


def test_uneven_hosts() -> None:
    out = run_ranks(_hierarchical_job, 3, [2, 1], "1", False, init=False, timeout=60)
    assert [r["leader"] for r in out] == [0, 0, 2]
    assert [r["mode"] for r in out] == ["leader"] * 3
    assert all(int(r["calls"]) > 0 for r in out)  # type: ignore[call-overload]


def test_one_rank_per_host_stays_flat() -> None:
    out = run_ranks(_hierarchical_job, 2, [1, 1], "1", False, init=False, timeout=60)
    assert [r["active"] for r in out] == [False, False]



def _allreduce_until_error(rank: int) -> str:
    as_host(rank, [2, 2], "1")
    hvd.init()
    assert runtime.hierarchy() is not None and runtime.hierarchy().mode == "shm"  # type: ignore[union-attr]
    if rank == 3:
        threading.Timer(0.3, os._exit, (9,)).start()  # dies mid-way, without a word to anyone
    t = torch.ones(16 * 2**20 // 4)
    start = time.monotonic()
    try:
        for _ in range(200):
            hvd.allreduce_(t, op=hvd.Sum)
    except hvd.HorovodInternalError as e:
        took = time.monotonic() - start
        assert took < 30, f"noticed the lost rank only after {took:.1f} s"  # a deadline, not a speed figure
        return str(e)
    return "no error"


def _rank_dies_mid_allreduce(rank: int, size: int) -> str:
    """Rank 3 exits 0.3 s into a run of large shared-memory hierarchical allreduces (in a child process, so
    that this harness rank can report it)."""
    if rank != 3:
        return _allreduce_until_error(rank)
    pid = os.fork()
    if pid == 0:
        _allreduce_until_error(rank)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return f"died with {os.waitstatus_to_exitcode(status)}"


def test_a_rank_dying_in_a_shared_memory_allreduce_fails_the_others_at_once() -> None:
    """The shared-memory way runs on hora's own thread and waits on the host's barriers: a host peer that
    dies mid-way must end the others' op at once, reported as a flat allreduce's backend failure is (the lost
    rank is named when hora's own connections notice first), not leave them waiting."""
    out = run_ranks(_rank_dies_mid_allreduce, 4, init=False, timeout=90)
    assert out[3] == "died with 9"
    for message in out[:3]:
        assert "rank 3 on host" in message or (
            "failed in the communication backend" in message and "A peer process probably died" in message), message
