"""Lifecycle and topology: errors before init, shutdown/init cycles, size 1, other launchers' variables,
and hora's group being torch.distributed's default group (DDP and raw calls in the same script)."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist

import hora as hvd
from tests.distributed.expect import close, rank_input, reduce
from tests.distributed.harness import run_ranks

TOPOLOGY = ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank", "is_homogeneous")
BUILD = ("gloo_built", "gloo_enabled", "nccl_built", "cuda_built", "mpi_built", "mpi_enabled",
         "mpi_threads_supported", "ccl_built", "ddl_built", "rocm_built")
LAUNCHER_VARS = ("HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK",
                 "HORA_CROSS_SIZE", "HORA_STORE_ADDR", "HORA_STORE_PORT", "HORA_JOB_ID")


def _topology(rank: int, size: int) -> dict:
    return {name: getattr(hvd, name)() for name in TOPOLOGY}


def _lifecycle(rank: int, size: int) -> list:
    assert hvd.is_initialized() is False
    for name in TOPOLOGY:
        with pytest.raises(hvd.NotInitializedError, match=r"init\(\)"):
            getattr(hvd, name)()
    with pytest.raises(hvd.NotInitializedError):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(hvd.ConfigError, match="comm"):
        hvd.init(comm=[0, 1])
    cycles = []
    for cycle in range(3):
        hvd.init()
        hvd.init()  # a second init while initialised does nothing
        assert hvd.is_initialized() is True
        topo = _topology(rank, size)
        x = [rank_input(r, (3,), torch.float32, salt=cycle) for r in range(size)]
        close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(x, hvd.Sum), f"allreduce in init cycle {cycle}")
        close(hvd.allgather(x[rank]), torch.cat(x), f"allgather in init cycle {cycle}")
        hvd.shutdown()
        assert hvd.is_initialized() is False
        with pytest.raises(hvd.NotInitializedError):
            hvd.rank()
        cycles.append(topo)
    hvd.shutdown()  # a second shutdown does nothing
    return cycles


def test_errors_before_init_and_shutdown_then_init() -> None:
    results = run_ranks(_lifecycle, 2, init=False)
    for rank, cycles in enumerate(results):
        want = {"size": 2, "rank": rank, "local_size": 2, "local_rank": rank, "cross_size": 1, "cross_rank": 0,
                "is_homogeneous": True}
        assert cycles == [want] * 3


def _builds(rank: int, size: int) -> dict:
    return {name: getattr(hvd, name)() for name in BUILD}


def test_build_queries_answer_for_the_torch_in_use() -> None:
    got = run_ranks(_builds, 1)[0]
    assert all(isinstance(v, bool) for k, v in got.items() if k != "nccl_built"), got
    assert isinstance(got["nccl_built"], int)  # Horovod's NCCL_VERSION_CODE, 0 without NCCL
    assert got["gloo_built"] is True and got["gloo_enabled"] is True
    assert got["cuda_built"] is (torch.version.cuda is not None)
    assert got["rocm_built"] is (torch.version.hip is not None)
    assert got["mpi_enabled"] is False and got["ccl_built"] is False and got["ddl_built"] is False


def _single(rank: int, size: int) -> dict:
    hvd.init()
    try:
        x = rank_input(0, (4, 2), torch.float32)
        close(hvd.allreduce(x), x, "size-1 allreduce")
        close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0), x * 2, "size-1 allreduce with prescale")
        close(hvd.allgather(x), x, "size-1 allgather")
        close(hvd.broadcast(x, 0), x, "size-1 broadcast")
        close(hvd.alltoall(x), x, "size-1 alltoall")
        close(hvd.reducescatter(x, op=hvd.Sum), x, "size-1 reducescatter")
        # async ops go through the negotiator thread (sync ones run their round on the caller's thread)
        handles = [hvd.allreduce_async(x * i, op=hvd.Sum, name=f"a{i}") for i in range(3)]
        for i, h in enumerate(handles):
            close(hvd.synchronize(h), x * i, "size-1 async allreduce")
        first, second = hvd.synchronize(hvd.grouped_allreduce_async([x, 2 * x], op=hvd.Sum))
        close(first, x, "size-1 grouped allreduce")
        close(second, 2 * x, "size-1 grouped allreduce")
        hvd.barrier()
        return {**_topology(0, 1), "join": hvd.join()}
    finally:
        hvd.shutdown()


def test_single_process_without_any_launcher_environment() -> None:
    got = run_ranks(_single, 1, init=False, env={k: None for k in LAUNCHER_VARS})[0]
    assert got == {"size": 1, "rank": 0, "local_size": 1, "local_rank": 0, "cross_size": 1, "cross_rank": 0,
                   "is_homogeneous": True, "join": 0}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _other_launcher(rank: int, size: int, style: str) -> dict:
    import os

    if style == "torchrun":
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    else:
        os.environ.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(size), HOROVOD_LOCAL_RANK=str(rank),
                          HOROVOD_LOCAL_SIZE=str(size))
    hvd.init()
    try:
        x = [rank_input(r, (3,), torch.float64) for r in range(size)]
        close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(x, hvd.Sum), f"allreduce under {style}")
        return _topology(rank, size)
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("style", ["torchrun", "horovod"])
def test_init_under_other_launchers_variables(style: str) -> None:
    env = {k: None for k in LAUNCHER_VARS} | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port()}
    results = run_ranks(_other_launcher, 2, style, init=False, env=env)
    assert [(t["rank"], t["size"], t["local_rank"], t["local_size"]) for t in results] == [(0, 2, 0, 2), (1, 2, 1, 2)]


def _with_ddp(rank: int, size: int) -> list:
    assert dist.is_initialized(), "hora's group is torch.distributed's default group"
    assert (dist.get_rank(), dist.get_world_size()) == (hvd.rank(), hvd.size())
    x = [rank_input(r, (3,), torch.float32) for r in range(size)]
    # a hora op in flight while the user's raw collectives and DDP run on the default group
    h = hvd.allreduce_async(x[rank], op=hvd.Sum, name="in-flight")
    raw = x[rank].clone()
    dist.all_reduce(raw)
    close(raw, reduce(x, hvd.Sum), "raw torch.distributed.all_reduce")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = [rank_input(r, (5, 3), torch.float32, salt=1) for r in range(size)]
    ddp(data[rank]).pow(2).sum().backward()
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    ref_grads = []
    for r in range(size):
        ref.zero_grad()
        ref(data[r]).pow(2).sum().backward()
        ref_grads.append(ref.weight.grad.clone())
    close(model.weight.grad, reduce(ref_grads, hvd.Average), "DDP averaged the gradients", atol=1e-5, rtol=1e-5)
    close(hvd.synchronize(h), reduce(x, hvd.Sum), "hora op that was in flight")
    obj: list = [None] * size
    dist.all_gather_object(obj, {"rank": rank})
    return [o["rank"] for o in obj]


def test_ddp_and_raw_torch_distributed_in_the_same_script() -> None:
    assert run_ranks(_with_ddp, 2) == [[0, 1], [0, 1]]


def _user_made_group(rank: int, size: int) -> int:
    import os

    store = dist.TCPStore(os.environ["HORA_STORE_ADDR"], int(os.environ["HORA_STORE_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("user", store), rank=rank, world_size=size)
    hvd.init()  # joins the user's default group instead of making one
    x = [rank_input(r, (3,), torch.float32) for r in range(size)]
    close(hvd.allreduce(x[rank], op=hvd.Sum), reduce(x, hvd.Sum), "hora on the user's default group")
    hvd.shutdown()
    assert dist.is_initialized(), "shutdown leaves a default group hora did not make"
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def test_init_after_the_script_made_the_default_group() -> None:
    assert run_ranks(_user_made_group, 2, init=False) == [2, 2]


def _default_group_without_cpu(rank: int, size: int) -> dict[str, object]:
    """The script's default group has no backend for CPU tensors (``init_process_group("cuda:gloo")``: what
    ``init_process_group("nccl")`` gives under torchrun, on a machine without CUDA): hora's CPU collectives
    go through its own Gloo groups all the same."""
    import os

    store = dist.TCPStore(os.environ["HORA_STORE_ADDR"], int(os.environ["HORA_STORE_PORT"]), is_master=False)
    mine = dist.PrefixStore(f"user/{os.environ['HORA_JOB_ID']}", store)  # the session's store: this test's keys
    dist.init_process_group("cuda:gloo", store=mine, rank=rank, world_size=size)
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1))  # the script's own group: no CPU backend, as with NCCL alone
        hvd.init()
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 2)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # checks the layout with a CPU allgather
        torch.manual_seed(0)
        close(model.weight.detach(), torch.nn.Linear(4, 2).weight.detach(), "rank 0's parameters everywhere")
        got = hvd.broadcast_object({"from": rank}, root_rank=1)
        metric = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="a CPU metric")
        hvd.shutdown()
        return {"object": got, "metric": metric.item()}
    finally:
        dist.destroy_process_group()


def test_a_default_group_without_a_cpu_backend_still_carries_horas_cpu_collectives() -> None:
    assert run_ranks(_default_group_without_cpu, 2, init=False) == [{"object": {"from": 1}, "metric": 3.0}] * 2


def _late_rank_at_ddp(rank: int, size: int) -> list[float]:
    """A rank reaches the default group's collective long after the start timeout (evaluation, a checkpoint):
    the others wait for it, as the collective timeout allows, instead of failing after the start timeout."""
    hvd.init()
    if rank == 1:
        time.sleep(3.0)  # the start timeout is 1 s
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)  # the default group hora made: what DDP uses
    late = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after the late rank")
    return [*t.tolist(), late.item()]


def test_the_default_group_waits_past_the_start_timeout() -> None:
    env = {"HORA_START_TIMEOUT": "1", "HORA_COLLECTIVE_TIMEOUT": "120"}
    assert run_ranks(_late_rank_at_ddp, 2, env=env) == [[3.0, 3.0, 2.0]] * 2


def _peer_dies(rank: int, size: int) -> str:
    hvd.init()
    hvd.allreduce(torch.ones(1))
    if rank == 1:
        return "left"  # the process exits without shutdown(): its connections close, as when it crashes
    errors = []
    for _ in range(2):  # the first call notices; later calls fail at once instead of hanging
        with pytest.raises(hvd.HorovodInternalError) as info:
            hvd.allreduce(torch.ones(1))
        errors.append(type(info.value).__name__)
    hvd.shutdown()  # still returns with the peer gone
    return ",".join(errors)


def test_a_dead_peer_surfaces_as_horovod_internal_error() -> None:
    """A peer's loss is a PeerLostError (a HorovodInternalError, which elastic training recovers from), on the
    call that notices it and on every later one."""
    assert run_ranks(_peer_dies, 2, init=False) == ["PeerLostError,PeerLostError", "left"]


def _interrupted(rank: int, size: int) -> list[str]:
    """Ctrl-C (KeyboardInterrupt) lands while a synchronous op runs its round, as in a notebook cell."""
    from hora.runtime import lifecycle as runtime

    hvd.init()
    plane = runtime.state().negotiator._plane
    allgather = plane.allgather

    def interrupted(payload: bytes) -> list[bytes]:
        raise KeyboardInterrupt

    plane.allgather = interrupted
    seen = []
    try:
        hvd.allreduce(torch.ones(100), name="a")
    except KeyboardInterrupt:
        seen.append("KeyboardInterrupt")
    plane.allgather = allgather
    with pytest.raises(hvd.HorovodInternalError) as error:
        hvd.allreduce(torch.ones(100), name="b")
    seen.append(str(error.value))
    hvd.shutdown()
    hvd.init()  # starts over: collectives work again
    seen.append(str(hvd.allreduce(torch.full((100,), 2.0), name="c", op=hvd.Sum)[0].item()))
    hvd.shutdown()
    return seen


def test_an_interrupted_round_fails_later_ops_until_hora_restarts() -> None:
    seen = run_ranks(_interrupted, 1, init=False)[0]
    assert seen[0] == "KeyboardInterrupt"
    assert "negotiation round was interrupted" in seen[1] and "hvd.shutdown() then hvd.init()" in seen[1]
    assert seen[2] == "2.0"
