"""hora: Horovod's API and launcher, in pure Python, on torch.distributed.

    import hora as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())          # GPUs only
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

This module only gathers the public names; the logic lives in the modules named below.
"""

from __future__ import annotations

import importlib as _importlib
from typing import Any as _Any

__version__ = "0.1.0"

# --- errors -------------------------------------------------------------------------------------------
from hora.errors import (  # noqa: F401
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    HoraError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidCallError,
    JobFailedError,
    PeerLostError,
    PeerRejectedCallError,
    LaunchError,
    ModelMismatchError,
    NotInitializedError,
    ObjectAuthError,
    SetupError,
    ShardStateLostError,
    StoreAuthError,
    UnsafeObjectError,
    UnsupportedCallError,
    UnsupportedDtypeError,
)

# --- compression --------------------------------------------------------------------------------------
from hora.datapath.compression import Compression, Compressor  # noqa: F401

# --- lifecycle, topology, process sets (runtime.py, process_sets.py, build.py) ------------------------
from hora.api.build_info import (  # noqa: F401
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from hora.common.process_sets import ProcessSet, global_process_set  # noqa: F401
from hora.runtime.lifecycle import (  # noqa: F401
    add_process_set,
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)

# --- collectives (ops.py, grouped.py, sparse.py, handles.py, reduce_ops.py) ------------------------------
from hora.datapath.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from hora.engine.handles import Handle, poll, synchronize  # noqa: F401
from hora.api.ops import (  # noqa: F401
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    join,
    reducescatter,
    reducescatter_async,
)
from hora.api.grouped import (  # noqa: F401
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
)
from hora.api.sparse import sparse_allreduce_async  # noqa: F401

# --- helpers, optimizer, SyncBatchNorm (functions.py, optimizer.py, sync_batch_norm.py) ---------------
from hora.api.functions import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.training.optimizer import DistributedOptimizer  # noqa: F401
from hora.training.sync_batch_norm import SyncBatchNorm  # noqa: F401

# --- diagnostics (diagnostics/) ------------------------------------------------------------------------
from hora.diagnostics import start_timeline, stop_timeline  # noqa: F401

# --- launching from Python (launch/) -------------------------------------------------------------------
from hora.launcher.pyfunc.run import run  # noqa: F401


def __getattr__(name: str) -> _Any:
    """``hvd.elastic`` as in Horovod, imported on first use."""
    if name == "elastic":
        return _importlib.import_module("hora.elastic")
    raise AttributeError(f"module 'hora' has no attribute {name!r}")
