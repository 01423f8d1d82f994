"""What the cluster frameworks (``hora.ray``, ``hora.spark``) share: the import check that names the
extra to install, and the one-line report of a failed rank (which rank it is: the one rule of
:mod:`hora.launcher.supervision.root_cause`).

Example:
    >>> rank_failed("hora.ray", 1, "node 10.0.0.2", "signal SIGKILL (9)")
    'hora.ray: rank 1 on node 10.0.0.2 failed: signal SIGKILL (9)'
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` (e.g. ``"ray"``) or fail with an ImportError saying which hora extra brings it.

    Raises:
        ImportError: ``module`` is not installed in this Python; the message names ``pip install hora[extra]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{feature} needs {module}, which is not installed in this Python: install it with "
            f"`pip install 'hora[{extra}]'` (or `pip install {module}`) and run again"
        ) from e


def rank_failed(framework: str, rank: int, where: str, how: str) -> str:
    """The headline of a job that one of its ranks ended: the framework, the rank, where it ran, what happened."""
    return f"{framework}: rank {rank} on {where} failed: {how}"
