"""``hvd.elastic.run``: the retry loop around an elastic training function (Horovod's semantics).

    sync the state from rank 0 -> call the function
      -> a collective failed (HorovodInternalError): restore the last commit, reset, sync, call again
      -> hosts changed (HostsUpdatedInterrupt at a commit): keep the current state, reset, sync unless only
         hosts were removed and the new world holds no new worker, call again
      -> it returned: return its value

A reset (:func:`hora.runtime.lifecycle.reset`) leaves the old world and joins the launcher's next one: new ranks, a
new store prefix, new process groups (the default group too), a new control mesh and negotiator; the
``DistributedOptimizer`` plans new buckets for the new size at its next step. A worker that the new world
leaves out exits with code 0. Outside an elastic job (no ``hora run --min-np``), there is no next world: the
function runs once and a failed collective is raised as it is.

A worker that started while the job was running built its model and state alone (``hvd.init()`` gave it a
world of its own and showed it its place in the job's, :mod:`hora.runtime.newcomer`): the first call joins the job's
world before the first sync (unless a collective joined already), so the others waited for it only for the
join and the sync; the reset callbacks run then only if it joined elsewhere than ``hvd.init()`` said.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from hora.elastic.notifications import notification_manager
from hora.elastic.state import State
from hora.errors import (
    CollectiveError,
    CollectiveMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    PeerLostError,
)
from hora.runtime import elastic_rendezvous as world
from hora.runtime import lifecycle as runtime
from hora.runtime import newcomer

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Decorate an elastic training function ``func(state, *args, **kwargs)``; see the module docstring.

    Example:
        >>> @hvd.elastic.run
        ... def train(state):
        ...     for state.epoch in range(state.epoch, epochs):
        ...         ...
        ...         state.commit()
        >>> train(hvd.elastic.TorchState(model, optimizer, epoch=0))  # doctest: +SKIP
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        rt = runtime.state("hvd.elastic.run")
        elastic = rt.env.elastic or rt.alone  # alone: a new worker of an elastic job, built in a world of its own
        notification_manager.register_listener(state)  # rank 0: the launcher's news in state._host_messages
        try:
            return _run(state, elastic, func, args, kwargs)
        finally:
            notification_manager.remove_listener(state)

    return wrapper  # type: ignore[return-value]


def _run(state: State, elastic: bool, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The retry loop (see the module docstring)."""
    skip_sync = False
    while True:
        try:
            newcomer.join("hvd.elastic.run")  # a new worker still alone joins the job's world now
            if newcomer.moved():  # ... elsewhere than hvd.init() said: the callbacks see where it is
                state.on_reset()
            if not skip_sync:
                state.sync()
            return func(state, *args, **kwargs)
        except CollectiveMismatchError:
            raise  # a programming error: the next world would meet it again
        except HorovodInternalError as e:
            if not elastic:
                raise
            # a lost peer is hora run's to report (one line, with the cause); anything else is news
            log.log(logging.INFO if isinstance(e, PeerLostError) else logging.WARNING,
                    "hora elastic: %s; restoring the last commit and resetting", _first_line(e))
            state.restore()
            skip_sync, failed = False, True
        except HostsUpdatedInterrupt as e:
            skip_sync, failed = e.skip_sync, False
        _reset(failed)
        skip_sync = skip_sync and not world.grew()  # a new worker is in the new world: it needs the state
        state.on_reset()


def _reset(failed: bool) -> None:
    """Join the next world (``failed``: a collective of the old world failed); a collective failing during
    the join (a member of the new world died) means one more reset."""
    while True:
        try:
            runtime.reset(failed=failed)
            return
        except CollectiveError as e:
            log.warning("hora elastic: the new world failed while starting (%s); resetting again", _first_line(e))
            failed = True


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
