"""``shutdown()`` then ``init()``, 20 times in one process: with ops in flight, with Ctrl-C landing during a
negotiation round, and with a peer whose process dies each time. Nothing hangs (the harness's deadline),
every op left in flight fails with a clear error, and nothing leaks: no hora thread, no socket, no process
group outlives its runtime."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import hora as hvd
from tests.distributed.harness import rank_store, run_ranks
from tests.polling import wait_until

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


def _hora_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hora-"))


def _leftovers() -> dict[str, object]:
    """What a runtime that is gone must not leave behind. Daemon threads get a moment to return."""
    wait_until(lambda: not _hora_threads(), timeout=10.0)
    return {"threads": _hora_threads(), "sockets": _sockets(), "default group": dist.is_initialized(),
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
    """Ranks 0 and 1 live through every cycle; rank 2 is a new process each time, forked by rank 1 before its
    own init() (so it comes to the job's next init() with as many behind it as its peers, as a process's n-th
    init() meets its peers' n-th), and dies without shutdown() while the others wait for it."""
    seen = []
    store = rank_store()
    for cycle in range(CYCLES):
        if rank == 1:
            # fork from a quiet process: no thread of the last runtime may hold a lock the child inherits
            assert wait_until(lambda: not _hora_threads(), timeout=10.0), _hora_threads()
            pid = os.fork()
            if pid == 0:
                try:
                    # the store by another name: a client of its own, not the one inherited from rank 1 (whose
                    # socket rank 1 goes on using)
                    os.environ.update(HORA_RANK="2", HORA_LOCAL_RANK="2", HORA_STORE_ADDR="localhost")
                    hvd.init()
                    hvd.allreduce(torch.ones(1), name=f"all.{cycle}", op=hvd.Sum)
                    for peer in (0, 1):  # they submitted the ops they will wait for in vain
                        rank_store().get(f"submitted.{cycle}.{peer}")
                finally:
                    os._exit(0)
        hvd.init()
        assert hvd.allreduce(torch.ones(1), name=f"all.{cycle}", op=hvd.Sum).item() == 3
        waiting = [hvd.allreduce_async(torch.ones(2), name=f"never.{cycle}.{i}") for i in range(3)]
        store.set(f"submitted.{cycle}.{rank}", "1")
        for h in waiting:
            with pytest.raises(hvd.HorovodInternalError, match="rank 2 on host .* is gone"):
                hvd.synchronize(h)
        hvd.shutdown()
        if rank == 1:
            os.waitpid(pid, 0)
        if cycle in (0, CYCLES - 1):
            seen.append(_leftovers())
    return seen


def test_shutdown_init_20_times_with_a_peer_gone() -> None:
    for rank, (first, last) in enumerate(run_ranks(_peer_dies_each_time, 2, init=False, timeout=240,
                                                   env={"HORA_SIZE": "3", "HORA_LOCAL_SIZE": "3"})):
        assert last["threads"] == [] and not last["default group"] and last["groups"] == 0, (rank, last)
        # one listening socket on 127.0.0.1 comes and goes between cycles here (1 or 2 sockets at any cycle, in
        # runs of 20 cycles printing the count each time); a socket leaked per cycle shows as 19 more
        assert last["sockets"] <= first["sockets"] + 1, f"rank {rank} leaks sockets: {first} -> {last}"
