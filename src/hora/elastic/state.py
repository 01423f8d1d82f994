"""What an elastic job keeps across resets: ``State``, ``ObjectState`` and ``TorchState`` (Horovod's API).

A state is saved in memory by ``commit()`` (``save()`` then ``check_host_updates()``), put back by
``restore()`` after a failed collective, and copied from rank 0 to every rank by ``sync()`` after each reset
(so workers that joined start from the survivors' state). ``check_host_updates()`` raises
``HostsUpdatedInterrupt`` on every rank at the same call when the launcher announced a host change.

Example:
    >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)   # doctest: +SKIP
    >>> state.epoch += 1; state.commit()                                      # doctest: +SKIP
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hora import functions, runtime, world
from hora.elastic.sampler import ElasticSampler
from hora.errors import HostsUpdatedInterrupt, NotInitializedError

log = logging.getLogger(__name__)


_POLL_S = 0.1  # how often rank 0 reads the launcher's host-update counter (one small store read)


class _UpdateWatch:
    """Host updates, with nothing on the step path: no store read and no collective per check.

    Rank 0 of each world runs a thread (started at its first check in that world) that reads the
    launcher's ``updates`` counter every ``_POLL_S`` and announces a new count through the negotiator
    (``Negotiator.announce``). Every check is a negotiator checkpoint (``Negotiator.checkpoint``: a lock and
    a counter); the engine hands the announcement out at the same checkpoint on every rank, agreed in two
    negotiation rounds (:mod:`hora.engine.notices` has the proof), so every rank raises at the same check.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.ref[runtime.Runtime] | None = None  # the world this process's thread watches
        self.announced = 0  # the last count of host updates this process announced (rank 0 of a world)

    def check(self) -> tuple[int, int, bool] | None:
        """(count acted on before, count announced now, only removals since) when this check is where every
        rank learns of host updates; None otherwise (and always outside an elastic job)."""
        rt = runtime.state("check_host_updates()")
        if not rt.env.elastic:
            return None
        if rt.topo.rank == 0 and (self._watched is None or self._watched() is not rt):
            self._start(rt)
        notices = rt.negotiator.checkpoint()
        if not notices:
            return None
        return min(n[0] for n in notices), max(n[1] for n in notices), all(n[2] for n in notices)

    def _start(self, rt: runtime.Runtime) -> None:
        with self._lock:
            if self._watched is not None and self._watched() is rt:
                return
            self._watched = weakref.ref(rt)
        raw = rt.store.underlying_store  # type: ignore[attr-defined]
        joined = world.joined()  # the count the world already reflects is no news
        seen = joined.updates if joined is not None else world.updates_count(raw, rt.env.job_id)
        threading.Thread(target=self._watch, args=(rt, raw, seen), name="hora-elastic-updates",
                         daemon=True).start()

    def _watch(self, rt: runtime.Runtime, raw: Any, seen: int) -> None:
        """Rank 0's thread: announce each new count of host updates until this world ends."""
        while True:
            time.sleep(_POLL_S)
            if not _current(rt):
                return
            try:
                now, removed_only = world.host_updates(raw, rt.env.job_id, seen)
            except Exception as e:  # the launcher and its store are gone: the job is ending anyway
                log.debug("hora elastic: stopped watching host updates: %s", e)
                return
            if now > seen:
                log.info("hora elastic: host update %d announced by the launcher", now)
                rt.negotiator.announce((seen, now, removed_only))
                seen = self.announced = now


def _current(rt: runtime.Runtime) -> bool:
    """``rt`` is still this process's live runtime (its world has not ended)."""
    try:
        return runtime.state() is rt
    except NotInitializedError:
        return False


_watch = _UpdateWatch()


class State:
    """Base of every elastic state (Horovod's ``horovod.common.elastic.State``).

    Args:
        bcast_object: how ``sync()`` sends Python objects from rank 0 (default ``hvd.broadcast_object``).
        get_rank: this process's rank (default ``hvd.rank``).
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object or functions.broadcast_object
        self._rank = get_rank or runtime.rank
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, e.g. to scale the learning rate to the
        new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``hvd.elastic.run`` after a reset: ``reset()``, then the registered callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in memory (a failure rolls back to here), then check for host changes.

        Raises:
            HostsUpdatedInterrupt: the launcher announced a host change; raised on every rank at this call.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` (on every rank at the same call) once the launcher has announced
        that hosts were added or removed. Every rank calls it at the same point (with the same number of
        calls before it), as a collective; it sends nothing itself: rank 0 watches the launcher's updates in
        the background and the negotiator's rounds agree on the check where every rank raises. Outside an
        elastic job it does nothing."""
        news = _watch.check()
        if news is not None:
            _, now, removed_only = news
            log.info("hora elastic: host update %d announced; resetting (skip_sync=%s)", now, removed_only)
            raise HostsUpdatedInterrupt(removed_only)

    def save(self) -> None:
        """Save the state in memory (subclasses)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put back the last saved state (subclasses)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank rank 0's state (subclasses)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt to the new world after a reset (subclasses; called before the reset callbacks)."""


class ObjectState(State):
    """Any picklable values as attributes: ``state = ObjectState(epoch=0, batch=0); state.epoch += 1``.

    ``save()`` remembers the attributes' current values, ``restore()`` puts them back, ``sync()`` gives
    every rank rank 0's saved values.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            object.__setattr__(self, name, value)


class _Handler:
    """Save/restore/sync of one torch object held by a TorchState."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """The world changed."""


def _copy_into(saved: Any, live: Any) -> Any:
    """A copy of ``live`` (a ``state_dict()``) that reuses ``saved``, the previous copy: tensors of the same
    shape, dtype and device are overwritten in place, so a commit allocates nothing once the state's shape
    is settled (a fresh large allocation costs page faults on every step). Anything else is deep-copied."""
    if isinstance(live, torch.Tensor) and live.layout == torch.strided:
        if (isinstance(saved, torch.Tensor) and saved is not live and saved.layout == torch.strided
                and saved.shape == live.shape and saved.dtype == live.dtype and saved.device == live.device):
            with torch.no_grad():
                saved.copy_(live)
            return saved
        return live.detach().clone()
    if isinstance(live, dict) and isinstance(saved, dict) and saved.keys() == live.keys():
        for key, value in live.items():
            saved[key] = _copy_into(saved[key], value)
        return saved
    if isinstance(live, list) and isinstance(saved, list) and len(saved) == len(live):
        saved[:] = [_copy_into(old, new) for old, new in zip(saved, live)]
        return saved
    return copy.deepcopy(live)


class _ModelHandler(_Handler):
    def save(self) -> None:
        self._saved = _copy_into(getattr(self, "_saved", None), self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)  # copies into the parameters and buffers: no aliasing

    def sync(self) -> None:
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def save(self) -> None:
        self._saved = _copy_into(getattr(self, "_saved", None), self.value.state_dict())

    def restore(self) -> None:
        # torch may keep the given tensors as the optimizer's state (no copy): hand it a copy, so training
        # after a restore never changes the saved commit (restores are rare; commits are not)
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        functions.broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    value: ElasticSampler

    def save(self) -> None:
        self._saved = self.value.state_dict()  # {"epoch", "processed_num"}: plain values, a copy already

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        # rank 0's epoch and count (every rank counted the same global batches)
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(), 0,
                                                              name="hora.elastic.sampler_state"))

    def reset(self) -> None:
        self.value.reset()  # deal the rest of the epoch over the new world, also when the reset skips sync()


_HANDLERS: tuple[tuple[type, type[_Handler]], ...] = (
    (ElasticSampler, _SamplerHandler),
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
)


class TorchState(ObjectState):
    """A model, an optimizer, ``ElasticSampler`` objects and any other values, kept across resets.

    ``save()`` copies the model's and optimizer's ``state_dict()`` in memory (into the last commit's tensors
    when their shapes still match: no allocation per commit); ``sync()`` broadcasts the
    model's parameters and buffers and the optimizer's state from rank 0 and the samplers' epoch and count of
    processed samples; ``reset()`` deals the samplers' remaining samples over the new world. Other keyword values
    behave as in :class:`ObjectState`. Assigning a new model or optimizer to the attribute (``state.model =
    new_model``) makes the state track the new object.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer``, e.g. a ``hvd.DistributedOptimizer`` (or None).
        **kwargs: more values; ``torch.nn.Module``, optimizer and ``ElasticSampler`` values are handled like
            ``model`` and ``optimizer``.
    """

    _handlers: dict[str, _Handler]

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                plain[name] = value
            else:
                handlers[name] = kind(value)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=functions.broadcast_object, get_rank=runtime.rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # a new object for a handled attribute: track it from now on
            handlers[name] = type(handlers[name])(value)
        object.__setattr__(self, name, value)
