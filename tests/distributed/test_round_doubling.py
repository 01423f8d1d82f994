"""Rounds by recursive doubling (``HORA_MESH_FULL_UPTO`` below the rank count), forced at 5 and 8 ranks: each
rank talks to about log2 n peers, results are exact, a mismatch fails on every rank naming every rank's
request, and a lost rank is named on every other rank, also on those with no connection to it."""

from __future__ import annotations

import time

import pytest
import torch

import hora as hvd
from hora.runtime import lifecycle as runtime
from tests.distributed.expect import close
from tests.distributed.harness import run_ranks
from tests.distributed.test_negotiation import _mismatches

DOUBLING = {"HORA_CONTROL_PLANE": "tcp", "HORA_MESH_FULL_UPTO": "1"}


def _exact_results(rank: int, size: int) -> list[int]:
    for step in range(20):  # new names, then cached ones: both kinds of round frame
        for i in range(3):
            got = hvd.allreduce(torch.full((3,), float(rank * step + i)), op=hvd.Sum, name=f"g{i}")
            close(got, torch.full((3,), float(step * sum(range(size)) + i * size)), f"step {step} g{i}")
    gathered = hvd.allgather(torch.full((rank + 1,), float(rank)), name="ag")
    close(gathered, torch.cat([torch.full((r + 1,), float(r)) for r in range(size)]), "allgather")
    close(hvd.broadcast(torch.full((2,), float(rank)), root_rank=size - 1, name="bc"), torch.full((2,), size - 1.0),
          "broadcast")
    return runtime.state().negotiator.round_peers


@pytest.mark.parametrize("nprocs", [5, 8])
def test_doubling_gives_exact_results_over_log_n_peers(nprocs: int) -> None:
    peers = run_ranks(_exact_results, nprocs, env=DOUBLING, timeout=120)
    p = 1 << (nprocs.bit_length() - 1)
    for rank, mine in enumerate(peers):
        partners = [rank - p] if rank >= p else sorted([rank ^ (1 << k) for k in range(p.bit_length() - 1)]
                                                       + ([rank + p] if rank < nprocs - p else []))
        assert mine == partners, f"rank {rank} talks to {mine}"


def test_doubling_a_mismatch_fails_on_every_rank_naming_every_rank() -> None:
    results = run_ranks(_mismatches, 5, env=DOUBLING, timeout=180)
    for rank, seen in enumerate(results):
        assert len(seen) == 9, f"rank {rank} saw {len(seen)} mismatches"
        for s in seen:
            assert s["ranks"] == list(range(5)), f"rank {rank}: every rank's request is named: {s['msg']}"
            assert all(f"rank {r}:" in s["msg"] for r in range(5)), s["msg"]
        assert [s["msg"] for s in seen] == [s["msg"] for s in results[0]], "every rank reports the same mismatch"


def _one_rank_leaves(rank: int, size: int, leaver: int) -> str:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="before")
    if rank == leaver:
        time.sleep(0.5)  # the others are already waiting for "after" when this process exits
        return "left"
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(torch.ones(1), name="after")  # the leaver never submits it
    connected = leaver in runtime.state().negotiator.round_peers
    return f"{'partner' if connected else 'stranger'}: {info.value}"


@pytest.mark.parametrize("nprocs,leaver", [(8, 5), (5, 2), (5, 4)])
def test_doubling_a_lost_rank_is_named_on_every_other_rank(nprocs: int, leaver: int) -> None:
    results = run_ranks(_one_rank_leaves, nprocs, leaver, timeout=120, init=False, env=DOUBLING)
    assert results[leaver] == "left"
    others = [m for r, m in enumerate(results) if r != leaver]
    assert any(m.startswith("stranger") for m in others), "some rank has no connection to the lost one"
    for message in others:
        assert f"rank {leaver} on host" in message and "is gone" in message, message
