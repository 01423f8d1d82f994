"""Every public name of :mod:`hora`, imported at once.

``hora/__init__.py`` loads this module the first time any public name is used (``hvd.init``, ``hvd.allreduce``,
``from hora import DistributedOptimizer``), so a plain ``import hora`` imports no torch, and neither does the
``hora`` command (``hora.launcher.cli``): its usage errors answer in a fraction of a second, not after the
seconds torch's import takes on a loaded machine (issue 33). Add a public name here; ``hora/__init__.py``
exposes whatever this module holds.
"""

from __future__ import annotations

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
from hora.datapath.wire import Compression, Compressor  # noqa: F401

# --- lifecycle, topology, process sets, what torch was built with -------------------------------------
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

# --- collectives, their handles and reduce ops -------------------------------------------------------
from hora.datapath.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from hora.engine.scheduling.handles import Handle, poll, synchronize  # noqa: F401
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

# --- helpers, optimizer, SyncBatchNorm ---------------------------------------------------------------
from hora.api.functions import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.training.optimizer import DistributedOptimizer  # noqa: F401
from hora.training.sync_batch_norm import SyncBatchNorm  # noqa: F401

# --- diagnostics ---------------------------------------------------------------------------------------
from hora.diagnostics import start_timeline, stop_timeline  # noqa: F401

# --- launching from Python -----------------------------------------------------------------------------
from hora.launcher.pyfunc.run import run  # noqa: F401
