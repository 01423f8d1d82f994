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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hora import functions, ops, runtime, world
from hora.elastic.sampler import ElasticSampler
from hora.errors import HostsUpdatedInterrupt

log = logging.getLogger(__name__)


class _UpdateWatch:
    """Rank 0's view of the launcher's host updates, shared by every state of this process: how many it has
    acted on, and in which world it last looked (a new world takes its starting count afresh)."""

    def __init__(self) -> None:
        self.gen = -1
        self.seen = 0

    def poll(self) -> tuple[int, int, bool]:
        """(seen before, announced now, only removals since): rank 0 reads the store, the others get its view."""
        rt = runtime.state("check_host_updates()")
        if not rt.env.elastic:
            return 0, 0, True
        raw = rt.store.underlying_store  # type: ignore[attr-defined]
        gen = runtime.world_generation()
        prev, now, removed_only = self.seen, self.seen, True
        if rt.topo.rank == 0:
            if gen != self.gen:  # the count the new world already reflects is no news
                joined = world.joined()
                prev = joined.updates if joined is not None else world.updates_count(raw, rt.env.job_id)
            now, removed_only = world.host_updates(raw, rt.env.job_id, prev)
        if rt.topo.size > 1:  # every rank raises at the same commit, or none does
            view = torch.tensor([prev, now, int(removed_only)], dtype=torch.int64)
            ops.broadcast_(view, 0, name="hora.elastic.host_updates")
            prev, now, flag = view.tolist()
            removed_only = bool(flag)
        self.gen, self.seen = gen, now
        return prev, now, removed_only


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
        """Raise ``HostsUpdatedInterrupt`` (on every rank at once) if hosts were added or removed since the
        last check. A collective: every rank calls it at the same point. Costs one store read on rank 0 and a
        3-integer broadcast; outside an elastic job it does nothing."""
        prev, now, removed_only = _watch.poll()
        if now > prev:
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


class _ModelHandler(_Handler):
    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        functions.broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        functions.broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    value: ElasticSampler

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        # every rank's processed samples (record_indices() records only the caller's), then rank 0's epoch
        processed: set[int] = set()
        for part in functions.allgather_object(self.value.processed_indices, name="hora.elastic.sampler"):
            processed |= part
        state = self.value.state_dict()
        state["processed_indices"] = processed
        self.value.load_state_dict(functions.broadcast_object(state, 0, name="hora.elastic.sampler_state"))

    def reset(self) -> None:
        self.value.reset()


_HANDLERS: tuple[tuple[type, type[_Handler]], ...] = (
    (ElasticSampler, _SamplerHandler),
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
)


class TorchState(ObjectState):
    """A model, an optimizer, ``ElasticSampler`` objects and any other values, kept across resets.

    ``save()`` copies the model's and optimizer's ``state_dict()`` in memory; ``sync()`` broadcasts the
    model's parameters and buffers and the optimizer's state from rank 0 and unites the samplers' processed
    samples; ``reset()`` re-splits the samplers' remaining samples over the new world. Other keyword values
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
