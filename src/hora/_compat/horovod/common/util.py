"""``horovod.common.util`` on hora: what a user's code (and Horovod's tests) call from it: which backends this build
has (each takes Horovod's ``verbose`` and ignores it: hora compiles nothing), ``env(...)``, and small helpers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from hora.api import build_info


def gloo_built(verbose: bool = False) -> bool:
    return build_info.gloo_built()


def nccl_built(verbose: bool = False) -> int:
    return build_info.nccl_built()


def mpi_built(verbose: bool = False) -> bool:
    return build_info.mpi_built()


def ddl_built(verbose: bool = False) -> bool:
    return build_info.ddl_built()


def ccl_built(verbose: bool = False) -> bool:
    return build_info.ccl_built()


def cuda_built(verbose: bool = False) -> bool:
    return build_info.cuda_built()


def rocm_built(verbose: bool = False) -> bool:
    return build_info.rocm_built()


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod asks whether its compiled extension for a framework loads: hora's is torch, always there."""
    return ext_base_name.rsplit(".", 1)[-1] == "torch"


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    import torch

    return extension_available(ext_base_name) and torch.cuda.is_available()


@contextlib.contextmanager
def env(**kwargs: Any) -> Iterator[None]:
    """Set environment variables inside the block (``None`` removes one); restore them after."""
    before = {name: os.environ.get(name) for name in kwargs}
    for name, value in kwargs.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum's condition)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    """``items`` cut into ``n`` consecutive parts of sizes differing by at most one."""
    size, extra = divmod(len(items), n)
    parts, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


def is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    from packaging.version import Version

    return Version(ver) >= Version(target)


def check_installed_version(name: str, version: str, exception: Exception | None = None) -> None:
    """Warn when the installed ``name`` is not ``version`` (``exception`` set: it could not be read)."""
    import warnings
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        found = installed(name)
    except PackageNotFoundError:
        return
    if found != version:
        warnings.warn(f"{name} {found} is installed; this code expected {version}", stacklevel=2)
