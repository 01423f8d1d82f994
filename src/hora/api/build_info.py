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


def nccl_built() -> int:
    """The NCCL version this torch ships, coded as Horovod's ``NCCL_VERSION_CODE`` (2.18.3 -> 21803), or 0.

    Horovod answers with the version too, and scripts compare it (``hvd.nccl_built() >= 2700``).
    """
    if not (dist.is_available() and dist.is_nccl_available()):
        return 0
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a torch without CUDA answers is_nccl_available() falsely
        return 0
    major, minor, patch = (tuple(version) + (0, 0, 0))[:3] if isinstance(version, tuple) else (0, 0, int(version))
    if (major, minor) >= (2, 9):
        return major * 10000 + minor * 100 + patch
    return major * 1000 + minor * 100 + patch


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
