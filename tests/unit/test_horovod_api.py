"""hora's public API against ``horovod.torch`` 0.28.1's (issue 11 item 12; what still differs is in
docs/horovod-differences.md).

The table below is Horovod 0.28.1's public surface, written down from its sources (the sdist from PyPI:
``pip download --no-deps --no-binary :all: horovod==0.28.1``, checked name by name against
``horovod/torch/__init__.py``, ``torch/mpi_ops.py``, ``common/basics.py``, ``common/process_sets.py``,
``torch/functions.py``, ``torch/optimizer.py``, ``torch/sync_batch_norm.py`` and ``runner/__init__.py``): every
name ``horovod/torch/__init__.py`` exports, each function's parameters in order with their defaults, and
``horovod.runner.run``. hora must take every call a Horovod script can make: the same names, the same
parameters in the same positions with the same defaults. hora may add parameters after Horovod's (with
defaults), and may give a default where Horovod requires the argument.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hora as hvd

REQ = object()  # Horovod requires the argument
GPS = "global_process_set"
NONE = "Compression.none"
AVG = "Average"

_REDUCE = [("average", None), ("name", None), ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0),
           ("process_set", GPS)]
_REDUCE_SYNC = [("average", None), ("name", None), ("compression", NONE), ("op", None), ("prescale_factor", 1.0),
                ("postscale_factor", 1.0), ("process_set", GPS)]
_SCATTER_SYNC = [("name", None), ("compression", NONE), ("op", AVG), ("process_set", GPS), ("prescale_factor", 1.0),
                 ("postscale_factor", 1.0)]
_SCATTER_ASYNC = [("name", None), ("op", AVG), ("process_set", GPS), ("prescale_factor", 1.0),
                  ("postscale_factor", 1.0)]
_BCAST = [("tensor", REQ), ("root_rank", REQ), ("name", None), ("process_set", GPS)]
_NOARGS = ("shutdown is_initialized stop_timeline size local_size cross_size rank local_rank cross_rank "
           "mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built "
           "cuda_built rocm_built").split()

HOROVOD_028: dict[str, list[tuple[str, Any]]] = {
    "allreduce": [("tensor", REQ), *_REDUCE_SYNC],
    "allreduce_async": [("tensor", REQ), *_REDUCE],
    "allreduce_": [("tensor", REQ), *_REDUCE],
    "allreduce_async_": [("tensor", REQ), *_REDUCE],
    "grouped_allreduce": [("tensors", REQ), *_REDUCE_SYNC],
    "grouped_allreduce_async": [("tensors", REQ), *_REDUCE],
    "grouped_allreduce_": [("tensors", REQ), *_REDUCE],
    "grouped_allreduce_async_": [("tensors", REQ), *_REDUCE],
    "sparse_allreduce_async": [("tensor", REQ), ("name", REQ), ("op", REQ), ("process_set", GPS)],
    "allgather": [("tensor", REQ), ("name", None), ("process_set", GPS)],
    "allgather_async": [("tensor", REQ), ("name", None), ("process_set", GPS)],
    "grouped_allgather": [("tensors", REQ), ("name", None), ("process_set", GPS)],
    "grouped_allgather_async": [("tensors", REQ), ("name", None), ("process_set", GPS)],
    "broadcast": _BCAST,
    "broadcast_async": _BCAST,
    "broadcast_": _BCAST,
    "broadcast_async_": _BCAST,
    "alltoall": [("tensor", REQ), ("splits", None), ("name", None), ("process_set", GPS)],
    "alltoall_async": [("tensor", REQ), ("splits", None), ("name", None), ("process_set", GPS)],
    "reducescatter": [("tensor", REQ), *_SCATTER_SYNC],
    "reducescatter_async": [("tensor", REQ), *_SCATTER_ASYNC],
    "grouped_reducescatter": [("tensors", REQ), *_SCATTER_SYNC],
    "grouped_reducescatter_async": [("tensors", REQ), *_SCATTER_ASYNC],
    "join": [("device", -1)],
    "barrier": [("process_set", GPS)],
    "poll": [("handle", REQ)],
    "synchronize": [("handle", REQ)],
    "init": [("comm", None), ("process_sets", None)],
    "start_timeline": [("file_path", REQ), ("mark_cycles", False)],
    "add_process_set": [("process_set", REQ)],
    "remove_process_set": [("process_set", REQ)],
    "broadcast_parameters": [("params", REQ), ("root_rank", REQ)],
    "broadcast_optimizer_state": [("optimizer", REQ), ("root_rank", REQ), ("model", None)],
    "broadcast_object": [("obj", REQ), ("root_rank", 0), ("name", None), ("process_set", GPS)],
    "allgather_object": [("obj", REQ), ("name", None)],
    "DistributedOptimizer": [("optimizer", REQ), ("named_parameters", None), ("compression", NONE),
                             ("backward_passes_per_step", 1), ("op", AVG), ("gradient_predivide_factor", 1.0),
                             ("num_groups", 0), ("groups", None), ("sparse_as_dense", False), ("process_set", GPS)],
    "SyncBatchNorm": [("num_features", REQ), ("eps", 1e-5), ("momentum", 0.1), ("affine", True),
                      ("track_running_stats", True)],
    # horovod/runner/__init__.py: the 0.25 names first, the deprecated np/min_np/max_np/network_interface kept
    "run": [("func", REQ), ("args", ()), ("kwargs", None), ("num_proc", 1), ("min_num_proc", None),
            ("max_num_proc", None), ("slots", None), ("reset_limit", None), ("cooldown_range", None), ("hosts", None),
            ("hostfile", None), ("host_discovery_script", None), ("start_timeout", None), ("ssh_port", None),
            ("ssh_identity_file", None), ("disable_cache", None), ("output_filename", None), ("verbose", None),
            ("use_gloo", None), ("use_mpi", None), ("mpi_args", None), ("network_interface", None),
            ("network_interfaces", None), ("executable", None), ("np", None), ("min_np", None), ("max_np", None)],
    **{name: [] for name in _NOARGS},
}
OTHER_NAMES = ("Compression ProcessSet global_process_set Average Sum Adasum Min Max Product "
               "HorovodInternalError").split()


def _same_default(hora_default: Any, horovod_default: Any) -> bool:
    if horovod_default == GPS:
        return hora_default is hvd.global_process_set
    if horovod_default == NONE:
        return hora_default is hvd.Compression.none
    if horovod_default == AVG:
        return hora_default == hvd.Average
    return type(hora_default) is type(horovod_default) and hora_default == horovod_default


@pytest.mark.parametrize("name", sorted(HOROVOD_028))
def test_every_horovod_028_function_takes_horovods_arguments_in_horovods_order(name: str) -> None:
    assert hasattr(hvd, name), f"horovod.torch.{name} is missing from hora"
    params = list(inspect.signature(getattr(hvd, name)).parameters.values())
    want = HOROVOD_028[name]
    got = [(p.name, p.default) for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [n for n, _ in got[: len(want)]] == [n for n, _ in want], f"{name}: parameters {got} vs Horovod {want}"
    for (pname, default), (_, horovod_default) in zip(got, want):
        if horovod_default is REQ:
            continue  # hora may give a default where Horovod requires the argument
        assert _same_default(default, horovod_default), f"{name}({pname}=...): default {default!r}, " \
                                                        f"Horovod's {horovod_default!r}"
    extra = [p for p in params if p.name not in {n for n, _ in want}]
    assert all(p.default is not p.empty for p in extra), f"{name}: hora's extra parameters need defaults"


def test_the_other_horovod_028_names_and_reduce_op_values() -> None:
    for name in OTHER_NAMES:
        assert hasattr(hvd, name), name
    assert [int(op) for op in (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product)] == list(range(6))
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hasattr(hvd.Compression, "none") and hasattr(hvd.Compression, "fp16")
    assert isinstance(hvd.nccl_built(), int) and not isinstance(hvd.nccl_built(), bool)  # a version, as Horovod's
    import hora.elastic

    assert hvd.elastic is hora.elastic
    for name in ("run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
                 "HostsUpdatedInterrupt"):
        assert hasattr(hvd.elastic, name), name


@pytest.fixture
def horovod_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import horovod`` gives hora's stand-in, as under ``hora run`` without a real Horovod."""
    compat = Path(hvd.__file__).parent / "_compat"
    monkeypatch.syspath_prepend(str(compat))
    yield
    for mod in [m for m in sys.modules if m == "horovod" or m.startswith("horovod.")]:
        del sys.modules[mod]


def test_horovods_submodules_import_under_the_stand_in(horovod_stand_in: None) -> None:
    import horovod
    import horovod.torch as hvd_torch
    from horovod.common.exceptions import HorovodInternalError
    from horovod.common.process_sets import ProcessSet
    from horovod.runner import run
    from horovod.torch.compression import Compression, FP16Compressor
    from horovod.torch.functions import broadcast_parameters
    from horovod.torch.mpi_ops import allreduce, handle_average_backwards_compatibility
    from horovod.torch.optimizer import DistributedOptimizer
    from horovod.torch.sync_batch_norm import SyncBatchNorm

    assert horovod.__version__ == "0.28.1" and horovod.run is run is hvd.run
    assert allreduce is hvd.allreduce and hvd_torch.mpi_ops.allreduce is hvd.allreduce
    assert broadcast_parameters is hvd.broadcast_parameters and DistributedOptimizer is hvd.DistributedOptimizer
    assert SyncBatchNorm is hvd.SyncBatchNorm and ProcessSet is hvd.ProcessSet
    assert HorovodInternalError is hvd.HorovodInternalError and Compression is hvd.Compression
    assert FP16Compressor is hvd.Compression.fp16
    with pytest.warns(DeprecationWarning):
        assert handle_average_backwards_compatibility(None, False) == hvd.Sum
    from horovod.torch.elastic import ElasticSampler, TorchState
    from horovod.torch.elastic import run as elastic_run

    assert hvd_torch.elastic.run is elastic_run is hvd.elastic.run
    assert TorchState is hvd.elastic.TorchState and ElasticSampler is hvd.elastic.ElasticSampler


def test_horovods_elastic_modules_import_under_the_stand_in(horovod_stand_in: None) -> None:
    """Horovod 0.28.1 scripts import the elastic pieces from their modules: horovod.torch.elastic.state (the
    handlers and their registry), .sampler, horovod.common.elastic (State, ObjectState, run_fn,
    notification_manager) and horovod.runner.elastic.worker (HostUpdateResult)."""
    from horovod.common.elastic import ObjectState, State, notification_manager, run_fn
    from horovod.runner.elastic.worker import HostUpdateResult, WorkerNotificationManager
    from horovod.torch.elastic.sampler import ElasticSampler
    from horovod.torch.elastic.state import (
        ModelStateHandler,
        OptimizerStateHandler,
        SamplerStateHandler,
        StateHandler,
        TorchState,
        get_handler_registry,
        set_handler_registry,
    )

    assert ElasticSampler is hvd.elastic.ElasticSampler and TorchState is hvd.elastic.TorchState
    assert State is hvd.elastic.State and ObjectState is hvd.elastic.ObjectState
    from hora.elastic.state import SchedulerStateHandler  # hora's: LR schedulers roll back with the state

    assert [h for _, h in get_handler_registry()] == [ModelStateHandler, OptimizerStateHandler, SchedulerStateHandler,
                                                      SamplerStateHandler]
    assert all(issubclass(h, StateHandler) for _, h in get_handler_registry()) and callable(set_handler_registry)
    assert isinstance(notification_manager, WorkerNotificationManager)
    assert [int(HostUpdateResult[n]) for n in ("no_update", "removed", "added", "mixed")] == [0, 1, 2, 3]
    assert callable(run_fn(lambda state: None, lambda: None))


def test_states_take_horovods_host_notifications_and_forget_them_at_a_reset() -> None:
    """Horovod 0.28.1's State queues ``on_hosts_updated(timestamp, result)`` in ``_host_messages`` (its
    integration script polls it on rank 0), and ``on_reset()`` forgets them before the reset callbacks."""
    from hora.elastic.notifications import HostUpdateResult

    state = hvd.elastic.ObjectState(bcast_object=lambda x: x, get_rank=lambda: 0, epoch=0)
    calls: list[bool] = []
    state.register_reset_callbacks([lambda: calls.append(state._host_messages.empty())])
    assert state._host_messages.empty()
    state.on_hosts_updated(17, HostUpdateResult.added)
    assert state._host_messages.get_nowait() == (17, HostUpdateResult.added)
    state.on_hosts_updated(18, HostUpdateResult.removed)
    state.on_reset()
    assert calls == [True]


def test_average_argument_warns_as_deprecated_as_in_horovod() -> None:
    from hora.datapath.reduce_ops import resolve_op

    with pytest.warns(DeprecationWarning, match="average="):
        assert resolve_op(None, False) == hvd.Sum
    with pytest.raises(ValueError, match="average"):
        resolve_op(hvd.Sum, True)


def test_run_refuses_horovods_mpi_arguments_with_the_reason() -> None:
    for kwargs, needle in (({"use_mpi": True}, "MPI"), ({"mpi_args": "-x"}, "MPI"), ({"use_gloo": False}, "Gloo")):
        with pytest.raises(hvd.ConfigError, match=needle):
            hvd.run(print, num_proc=1, **kwargs)


def test_run_warns_on_horovods_deprecated_spellings_and_lets_them_win_as_horovod_028_does() -> None:
    """Horovod 0.28.1's run() warns (DeprecationWarning) for np, min_np, max_np and network_interface and uses
    their values over num_proc, min_num_proc, max_num_proc and network_interfaces."""
    from hora.launcher.pyfunc.run import _deprecated_spellings

    for name in ("np", "min_np", "max_np", "network_interface"):
        with pytest.warns(DeprecationWarning, match=rf"hora.run\({name}=...\) is deprecated"):
            with pytest.raises(hvd.ConfigError, match="MPI"):
                hvd.run(print, use_mpi=True, **{name: "eth0" if name == "network_interface" else 2})
    with pytest.warns(DeprecationWarning):
        assert _deprecated_spellings(1, None, None, None, np=4, min_np=2, max_np=8, network_interface="eth0,ib0") \
            == (4, 2, 8, ["eth0", "ib0"])
    assert _deprecated_spellings(3, 2, 4, ["eth1"], np=None, min_np=None, max_np=None, network_interface=None) \
        == (3, 2, 4, ["eth1"])


def test_a_process_set_of_an_mpi_communicator_is_refused_naming_what_to_pass() -> None:
    """Horovod's ProcessSet(mpi4py_comm): a ConfigError with the fix, not a TypeError from iterating it."""

    class Communicator:  # what hora reads of an mpi4py communicator: its two methods
        def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
            return 0

        def Get_size(self) -> int:  # noqa: N802
            return 2

    with pytest.raises(hvd.ConfigError, match=r"pass the global ranks instead, e.g. hvd.ProcessSet\(\[0, 1\]\)"):
        hvd.ProcessSet(Communicator())  # type: ignore[arg-type]
    assert hvd.ProcessSet([1, 0]).ranks == [0, 1]
