"""Build queries (``hvd.nccl_built()`` ...), answered truthfully for the torch in use.

hora compiles nothing: what is "built" is what this torch ships. MPI, oneCCL and DDL are never used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gloo_built() -> bool:
    """True when this torch ships the Gloo backend (CPU collectives)."""
    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Gloo is hora's only controller and CPU data plane."""
    return gloo_built()


def nccl_built() -> bool:
    """True when this torch ships NCCL (CUDA collectives)."""
    return bool(dist.is_available() and dist.is_nccl_available())


def cuda_built() -> bool:
    """True when this torch was built with CUDA."""
    return bool(torch.backends.cuda.is_built()) and torch.version.cuda is not None


def rocm_built() -> bool:
    """True when this torch was built for ROCm."""
    return getattr(torch.version, "hip", None) is not None


def mpi_built() -> bool:
    """True when this torch ships the MPI backend (hora itself never uses it)."""
    return bool(dist.is_available() and dist.is_mpi_available())


def mpi_enabled() -> bool:
    """hora never runs collectives over MPI."""
    return False


def mpi_threads_supported() -> bool:
    """hora never runs collectives over MPI."""
    return False


def ccl_built() -> bool:
    """hora does not use oneCCL."""
    return False


def ddl_built() -> bool:
    """hora does not use IBM DDL."""
    return False
