"""``shutdown()`` then ``init()``, 20 times in one process: with ops in flight, with Ctrl-C landing during a
negotiation round, and with a peer whose process dies each time. Nothing hangs (the harness's deadline),
every op left in flight fails with a clear error, and nothing leaks: no hora thread, no socket, no process
group outlives its runtime."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import hora as hvd
from hora.runtime import lifecycle as runtime
from tests.distributed.harness import rank_store, run_ranks

CYCLES = 20


def _sockets() -> int:
    """Open sockets of this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return count


def _leftovers() -> dict[str, object]:
    """What a runtime that is gone must not leave behind. Daemon threads get a moment to return."""
    deadline = time.monotonic() + 10.0
    while True:
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("hora-"))
        if not threads or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {"threads": threads, "sockets": _sockets(), "default group": dist.is_initialized(),
            "groups": len(distributed_c10d._world.pg_map)}


def _in_flight_and_interrupted(rank: int, size: int) -> list[dict[str, object]]:
    seen = []
    side = rank_store()  # orders the Ctrl-C cycles' steps by events, not by sleeps
    # Ctrl-C raises KeyboardInterrupt, as at a terminal, also when the run was started in the background by a
    # non-interactive shell (`make test &`, some CI runners), whose children inherit SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for cycle in range(CYCLES):
        hvd.init()
        both = [hvd.allreduce_async(torch.full((4,), float(rank + cycle)), name=f"both.{cycle}.{i}", op=hvd.Sum)
                for i in range(3)]
        lonely = hvd.allreduce_async(torch.ones(2), name=f"only-on-{rank}.{cycle}")  # the peer never submits it
        for h in both:
            assert hvd.synchronize(h).tolist() == [float(1 + 2 * cycle)] * 4
        if cycle % 4 == 3:  # Ctrl-C while a synchronous op waits for the peer, which submits it only afterwards
            if rank == 0:
                with pytest.raises(KeyboardInterrupt):  # the timer inside: it may fire before the call, on a slow day
                    threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGINT)).start()
                    hvd.allreduce(torch.ones(1), name=f"slow.{cycle}")
                side.set(f"interrupted.{cycle}", "yes")
            else:
                side.get(f"interrupted.{cycle}")  # blocks until rank 0 took its Ctrl-C, however loaded the machine
                try:
                    hvd.allreduce(torch.ones(1), name=f"slow.{cycle}")
                except hvd.HorovodInternalError:  # rank 0's round was cut short: negotiation is over
                    pass
        hvd.shutdown()
        # after a Ctrl-C in a round, the interruption (rank 0) or the loss of rank 0 (rank 1) is the reason
        # (on the Gloo plane rank 1 may instead see rank 0's connection reset: "negotiation with peers failed")
        reason = ("interrupted|is gone|without submitting|negotiation with peers failed" if cycle % 4 == 3
                  else r"shutdown\(\) without submitting")
        with pytest.raises(hvd.HorovodInternalError, match=reason):
            hvd.synchronize(lonely)
        if cycle in (0, CYCLES - 1):
            seen.append(_leftovers())
    hvd.init()  # still usable after all that
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size
    hvd.shutdown()
    return seen


@pytest.mark.parametrize("plane", ["tcp", "gloo"])
def test_shutdown_init_20_times_with_ops_in_flight_and_ctrl_c(plane: str) -> None:
    for rank, (first, last) in enumerate(run_ranks(_in_flight_and_interrupted, 2, init=False, timeout=240,
                                                   env={"HORA_CONTROL_PLANE": plane})):
        assert last["threads"] == [] and not last["default group"] and last["groups"] == 0, (rank, last)
        assert last["sockets"] <= first["sockets"], f"rank {rank} leaks sockets: {first} -> {last}"


def _peer_dies_each_time(rank: int, size: int) -> list[dict[str, object]]:
    seen = []
    store = rank_store() if rank == 0 else None  # rank 1's are made in its forked children
    for cycle in range(CYCLES):
        if rank == 1:  # this cycle's rank 1 is a new process that dies (no shutdown) while rank 0 waits for it
            pid = os.fork()
            if pid == 0:
                try:
                    runtime._generation = cycle  # its init is the peer's (cycle+1)-th: the same store prefix
                    hvd.init()
                    hvd.allreduce(torch.ones(1), name=f"both.{cycle}")
                    rank_store().get(f"submitted.{cycle}")  # rank 0 submitted the ops it will wait for in vain
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
            continue
        hvd.init()
        hvd.allreduce(torch.ones(1), name=f"both.{cycle}")
        waiting = [hvd.allreduce_async(torch.ones(2), name=f"never.{cycle}.{i}") for i in range(3)]
        assert store is not None
        store.set(f"submitted.{cycle}", "1")
        for h in waiting:
            with pytest.raises(hvd.HorovodInternalError, match="rank 1 on host .* is gone"):
                hvd.synchronize(h)
        hvd.shutdown()
        if cycle in (0, CYCLES - 1):
            seen.append(_leftovers())
    return seen


def test_shutdown_init_20_times_with_a_peer_gone() -> None:
    first, last = run_ranks(_peer_dies_each_time, 2, init=False, timeout=240)[0]
    assert last["threads"] == [] and not last["default group"] and last["groups"] == 0, last
    # one listening socket on 127.0.0.1 comes and goes between cycles here (1 or 2 sockets at any cycle, in
    # runs of 20 cycles printing the count each time); a socket leaked per cycle shows as 19 more
    assert last["sockets"] <= first["sockets"] + 1, f"rank 0 leaks sockets: {first} -> {last}"
