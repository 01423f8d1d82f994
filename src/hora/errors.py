"""hora's error types. Every error says what went wrong, where, and how to fix it.

Horovod's names (``HorovodInternalError``, ``HostsUpdatedInterrupt``) are aliases of hora's own types, so
``except hvd.HorovodInternalError`` in an existing script catches what hora raises.

Each type carries the exit code a ``hora`` command returns when that error ends it (``exit_code``): 2 for a
usage or setup error (nothing was started), 1 for a job that went wrong, the job's own status for
:class:`JobFailedError`. The commands print the message as one line and return ``exc.exit_code``.
"""

from __future__ import annotations

from collections.abc import Mapping


class HoraError(Exception):
    """Base of every error hora raises on purpose."""

    exit_code: int = 1  # what a ``hora`` command returns when this error ends it


class NotInitializedError(HoraError, ValueError):
    """A topology query or collective was called before ``hora.init()``."""

    def __init__(self, what: str = "this call") -> None:
        super().__init__(
            f"hora has not been initialized: {what} needs hora.init() first. "
            "Call hvd.init() at the top of your training script."
        )
        self.what = what

    def __reduce__(self) -> tuple[type[NotInitializedError], tuple[str]]:
        # pickled (hora.run sends a rank's exception to its caller) as what it was made from, not its message,
        # which would come back wrapped a second time
        return type(self), (self.what,)


class ConfigError(HoraError, ValueError):
    """Bad configuration from the environment, a flag or a config file (exit code 2, as for a usage error)."""

    exit_code = 2


class CollectiveError(HoraError, RuntimeError):
    """A collective failed (a peer died, a link broke). Recoverable in elastic mode."""


class PeerLostError(CollectiveError):
    """This rank's collectives cannot go on because another rank is gone: its process ended or its link broke.

    A consequence, not a cause: the rank that went is the cause, and ``hora run``'s report names it (its exit
    code, its traceback); the message says which rank it was (``peer``). Elastic training recovers from it, as
    from any ``HorovodInternalError``.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer

    def __reduce__(self) -> tuple[type[PeerLostError], tuple[str, int | None]]:
        return type(self), (str(self), self.peer)


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks submitted the same collective name with different metadata.

    The message lists what each rank sent. The job goes on: later collectives work.
    """

    def __init__(self, name: str, per_rank: Mapping[int, str], fields: list[str], label: str = "",
                 hint: str = "") -> None:
        """``label``: the op as a user reads it (default ``collective 'name'``); ``hint``: how to fix it."""
        self.name = name
        self.per_rank = dict(per_rank)
        self.fields = fields
        lines = "\n".join(f"  rank {r}: {desc}" for r, desc in sorted(per_rank.items()))
        super().__init__(
            f"{label or f'collective {name!r}'}: ranks disagree on {', '.join(fields)}.\n{lines}\n"
            + (hint or "Every rank must submit a name with the same kind, dtype, shape, op, root, scale factors "
               "and process set; give different collectives different names.")
        )


class InvalidCallError(HoraError, ValueError, RuntimeError):
    """A collective called in a way that cannot work: a bad op for the kind, a tensor with no dimension to
    split, uneven rows for an alltoall without ``splits``, a root outside the process set...

    Raised at once on the calling rank, before anything is submitted, so the job goes on. It is a
    ``ValueError`` (what hora and Horovod raise for checks made before submitting) and a ``RuntimeError``
    (Horovod reports several of these from its background thread, and Horovod scripts catch them so).
    It is not a ``HorovodInternalError``: elastic training does not restart on a programming error.
    """


class ModelMismatchError(InvalidCallError):
    """``broadcast_parameters`` was given a different model on some ranks (parameters of other shapes or
    dtypes, or other parameters); raised on every member, naming the parameters that differ. A programming
    error, not a ``HorovodInternalError``: elastic training does not restart on it."""


class UnsupportedDtypeError(InvalidCallError, TypeError):
    """A dtype the collective cannot take (complex, bool for arithmetic ops). Also a ``TypeError``."""


class UnsupportedCallError(InvalidCallError, NotImplementedError):
    """A call Horovod answers with ``NotImplementedError`` (e.g. Adasum on a non-power-of-two number of ranks)."""


class PeerRejectedCallError(InvalidCallError):
    """Another member rejected its own call to this collective before sending it (a non-contiguous tensor, a
    bad root...); the message names that rank, its line and its reason. Like the error that rank got, an
    ``InvalidCallError``, not a ``HorovodInternalError``: nothing broke, and later collectives pair as before.
    """


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than the stall shutdown time."""


class WorldMemberLostError(CollectiveError):
    """Elastic: a member of the launcher's new world ended before the world's process groups were built (the
    launcher posted it on that world's board). ``init()`` handles it itself: it posts ready again and joins the
    world after it."""


class StoreAuthError(HoraError):
    """A value hora read from the rendezvous store failed authentication: a process without this job's secret
    wrote it (a stranger on the network, or a rank started with another secret). Raised before the value is
    parsed; the message names the key and the store's address. See docs/security.md."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key  # the store key whose value was refused


class ObjectAuthError(HoraError):
    """The bytes of an object ``broadcast_object`` or ``allgather_object`` received (over the data plane, which
    torch does not authenticate) failed the check with the job's secret: changed on the way or sent by a process
    without the secret. Raised before anything is unpickled; the message names the collective and the sender.
    See docs/security.md."""


class UnsafeObjectError(HoraError, ValueError):
    """An object cannot be sent or loaded safely: in a job without a secret, ``broadcast_object`` /
    ``allgather_object`` carry only what ``torch.load(weights_only=True)`` loads (tensors, numbers, strings,
    plain containers, and classes allowed with ``torch.serialization.add_safe_globals``). Raised on every member
    of the collective, naming the classes and the fix (give the job a secret)."""


class CheckpointError(HoraError, OSError):
    """A checkpoint could not be written, read or trusted (a missing shared directory, a full disk, a bad file,
    a file another user wrote). See docs/checkpoints in docs/elastic.md and docs/security.md."""


class HostsUpdatedInterrupt(HoraError):
    """The set of hosts changed; elastic training resets to pick up the new world, keeping its current state.

    Raised by ``State.commit()`` / ``check_host_updates()`` on every rank at the same call.

    Args:
        skip_sync: True when no state sync is needed: hosts were only removed, so every remaining rank
            already holds the same state.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class ShardStateLostError(HoraError):
    """Elastic: part of a sharded optimizer's state left with the ranks that held it (a rank and the neighbour
    that kept the copy of its shard both left the job between two commits); resume from a checkpoint."""


class ElasticTimeoutError(HoraError):
    """An elastic worker waited longer than the elastic timeout for the launcher's next world."""


class PlacementTimeoutError(ConfigError, TimeoutError):
    """A cluster framework could not place or start every rank within its start timeout (``hora.ray``'s placement
    group, ``hora.spark.run``'s barrier tasks); also a ``TimeoutError``, as Horovod raises one there."""


class LaunchError(HoraError):
    """The launcher could not start or finish the job (exit code 1)."""


class SetupError(LaunchError):
    """The launcher found a problem before starting anything: preflight, an agent that cannot start, a log
    directory it cannot write (exit code 2; nothing was started)."""

    exit_code = 2


class JobFailedError(LaunchError):
    """The job ended with a non-zero status; ``exit_code`` is that status (a rank's exit code, 128 + N for a
    rank killed by signal N)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.exit_code = status


# Horovod's names.
HorovodInternalError = CollectiveError

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ElasticTimeoutError",
    "HoraError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidCallError",
    "JobFailedError",
    "LaunchError",
    "ModelMismatchError",
    "NotInitializedError",
    "ObjectAuthError",
    "PeerLostError",
    "PeerRejectedCallError",
    "PlacementTimeoutError",
    "SetupError",
    "ShardStateLostError",
    "StoreAuthError",
    "UnsafeObjectError",
    "UnsupportedCallError",
    "UnsupportedDtypeError",
    "WorldMemberLostError",
]
