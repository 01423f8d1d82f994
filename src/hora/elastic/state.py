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
import queue
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hora.api import functions
from hora.elastic.notifications import HostUpdateResult, watch
from hora.elastic.sampler import ElasticSampler
from hora.errors import HostsUpdatedInterrupt
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)


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
        self._host_messages: queue.Queue[tuple[int, HostUpdateResult]] = queue.Queue()  # rank 0: what was found
        self._last_updated_timestamp = 0

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call each of ``callbacks`` (no arguments) after every reset, e.g. to scale the learning rate to the
        new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``hvd.elastic.run`` after a reset: forget the host messages, ``reset()``, then the registered
        callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        """Horovod's notification of a host change (the launcher found hosts added or removed): queued in
        ``_host_messages`` on rank 0 while ``hvd.elastic.run`` runs this state. The interrupt itself comes from
        ``check_host_updates()``."""
        self._host_messages.put((timestamp, update_res))

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
        while not self._host_messages.empty():  # taken in, as Horovod's check does (the news come below)
            self._last_updated_timestamp = max(self._last_updated_timestamp, self._host_messages.get()[0])
        news = watch.check()
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


class StateHandler:
    """How a ``TorchState`` saves, restores and syncs one kind of object (Horovod's ``StateHandler``). For an
    object of your own, subclass it and add ``(its type, your handler class)`` to the registry
    (:func:`set_handler_registry`); ``TorchState`` uses the first entry whose type the value is an instance of.

    Args:
        value: the object (``handler.value``).
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """A new object for the same attribute (``state.model = other``): track it, and save it."""
        self.value = value
        self.save()

    def reset(self) -> None:
        """The world changed (hora calls it after every reset, before the reset callbacks)."""


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


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: its ``state_dict()`` saved in memory, parameters and buffers broadcast by sync."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.save()

    def save(self) -> None:
        self._saved = _copy_into(getattr(self, "_saved", None), self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)  # copies into the parameters and buffers: no aliasing

    def sync(self) -> None:
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer``: its ``state_dict()`` saved in memory, broadcast by sync.

    A sharded ``DistributedOptimizer`` (``sharding=...``) keeps no second full copy: a commit keeps this rank's
    shard and a copy of the previous rank's (sent here at the commit), so the state survives any one rank
    leaving; ``restore()`` puts this rank's shard back; ``sync()`` moves every entry to its owner in the new
    world (:meth:`hora.training.sharding.Sharding.settle`) and gives every rank rank 0's options (``lr`` ...).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._options: Any = None
        sharding = _sharding_of(optimizer)
        if sharding is not None:  # no collective here: a new worker builds its state before it joins the job
            sharding.snapshot(_copy_into)
            self._options = _copy_into(None, _options_of(optimizer))
        else:
            self.save()

    def save(self) -> None:
        sharding = _sharding_of(self.value)
        if sharding is not None:
            sharding.commit(_copy_into)
            self._options = _copy_into(self._options, _options_of(self.value))
            return
        self._saved = _copy_into(getattr(self, "_saved", None), self.value.state_dict())

    def restore(self) -> None:
        sharding = _sharding_of(self.value)
        if sharding is not None:
            sharding.restore()
            for group, options in zip(self.value.param_groups, copy.deepcopy(self._options)):
                group.update(options)
            return
        # torch may keep the given tensors as the optimizer's state (no copy): hand it a copy, so training
        # after a restore never changes the saved commit (restores are rare; commits are not)
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        sharding = _sharding_of(self.value)
        if sharding is not None:
            sharding.settle()
        functions.broadcast_optimizer_state(self.value, root_rank=0)  # sharded: rank 0's options only


def _sharding_of(optimizer: Any) -> Any:
    """The sharding of a ``DistributedOptimizer(sharding=...)`` (hora.training.sharding.Sharding), else None."""
    return getattr(optimizer, "_hora_sharding", None)


def _options_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class SchedulerStateHandler(StateHandler):
    """A learning-rate scheduler (``torch.optim.lr_scheduler``): its ``state_dict()`` saved, put back by
    restore (so a rollback also rolls the schedule back), rank 0's given to every rank by sync."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.save()

    def save(self) -> None:
        self._saved = _copy_into(getattr(self, "_saved", None), self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(functions.broadcast_object(self.value.state_dict(), 0,
                                                              name="hora.elastic.scheduler_state"))


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: its epoch and count saved, rank 0's given to every rank by sync, the rest of the
    epoch dealt over the new world at every reset."""

    value: ElasticSampler

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self.save()

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


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, SchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """The ``(type, handler class)`` pairs ``TorchState`` picks a value's handler from, in order."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the registry (e.g. ``set_handler_registry(get_handler_registry() + [(MyType, MyHandler)])``)."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    kind = next((h for t, h in _handler_registry if isinstance(value, t)), None)
    return None if kind is None else kind(value)


class TorchState(ObjectState):
    """A model, an optimizer, LR schedulers, ``ElasticSampler`` objects and any other values, kept across resets.

    ``save()`` copies the model's, optimizer's and schedulers' ``state_dict()`` in memory (into the last
    commit's tensors when their shapes still match: no allocation per commit; a sharded optimizer keeps its
    own shard and a copy of one neighbour's); ``sync()`` broadcasts the model's parameters and buffers, the
    optimizer's state (a sharded one's moves to its new owners) and the schedulers' state from rank 0 and the
    samplers' epoch and count of processed samples; ``reset()`` deals the samplers' remaining samples over the
    new world. Other keyword values behave as in :class:`ObjectState`. Assigning a new model or optimizer to
    the attribute (``state.model = new_model``) makes the state track the new object.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer``, e.g. a ``hvd.DistributedOptimizer`` (or None).
        **kwargs: more values; ``torch.nn.Module``, optimizer, LR scheduler
            (``torch.optim.lr_scheduler.LRScheduler``, e.g. ``scheduler=sched``) and ``ElasticSampler`` values
            are handled like ``model`` and ``optimizer``.
    """

    _handlers: dict[str, StateHandler]

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
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
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)
