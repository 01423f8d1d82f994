"""What the cluster frameworks (``hora.ray``, ``hora.spark``) share: the import check that names the
extra to install, and the one-line report of a failed rank.

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


# What a rank raises because a peer failed first (hora's "rank N ... is gone"): never the root cause while another
# rank failed otherwise. A CollectiveMismatchError is every rank's own error, not a follow-on.
FOLLOW_ON_ERRORS = frozenset({"CollectiveError", "PeerLostError", "WorldMemberLostError", "HorovodInternalError"})
FOLLOW_ON_GRACE_S = 5.0  # how long a driver waits for the root cause after seeing a follow-on error first


def is_follow_on(type_name: str | None) -> bool:
    """Whether an exception of this type (its ``__name__``) reports a peer's failure rather than its own."""
    return type_name in FOLLOW_ON_ERRORS


def rank_failed(framework: str, rank: int, where: str, how: str) -> str:
    """The headline of a job that one of its ranks ended: the framework, the rank, where it ran, what happened."""
    return f"{framework}: rank {rank} on {where} failed: {how}"
