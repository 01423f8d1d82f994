"""Sharded optimizer state: what ``DistributedOptimizer(sharding="optimizer" | "gradients")`` adds to a step.

Every member of the process set owns the optimizer state of some whole parameters (:mod:`hora.training.shard_plan`:
balanced bucket by bucket) and steps only those, with the wrapped optimizer itself, so its state exists only
on the owner (torch's optimizers create a parameter's state at its first update). Then the updated parameters
travel from their owners to everyone: the trainable parameters of each bucket live in one flat tensor laid
out by owner (:class:`ParamFlat`; the parameters' ``.data`` are views of it), and each owner's segment is one
in-place broadcast from that owner, all of a bucket's segments in one negotiation round. Nothing is copied or
allocated per step; a bucket is sent as soon as this rank's parameters in it are updated.

The partition belongs to one world (the process set's ranks, the ``init()``): after an elastic reset, the
first collective use of the optimizer (``step()``, a full ``state_dict()``, the elastic state's commit or
sync) *settles* the state: every member offers the entries it holds and takes those it now owns
(:mod:`hora.training.state_exchange`), from the rank that holds them live, or from the copy an elastic commit
keeps of each member's shard on the next member (:meth:`Sharding.commit`), when the owner left.

Example:
    >>> opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters()),   # doctest: +SKIP
    ...                                named_parameters=model.named_parameters(), sharding="optimizer")
    >>> opt.owned_parameter_names()   # doctest: +SKIP
    ['fc2.weight', 'fc1.bias']
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hora.api import ops
from hora.calls.call import Call
from hora.calls.submit import submit_many
from hora.datapath.kinds.op import Kind
from hora.datapath.reduce_ops import ReduceOp
from hora.engine.scheduling import handles
from hora.errors import ShardStateLostError
from hora.runtime import lifecycle as runtime
from hora.training import state_exchange
from hora.training.buckets import BucketNames, ParamSpec, plan_buckets
from hora.training.shard_plan import ShardLayout, assign_owners, layout

log = logging.getLogger(__name__)

MODES = ("optimizer", "gradients")
_MB = 1024 * 1024
World = tuple[int, tuple[int, ...]]  # (world generation, the process set's global ranks)
Place = tuple[World, int]  # (a world, a member of it)


@dataclass(frozen=True)
class Partition:
    """Who owns what in one world: ``owners[i]`` is the member (index into ``ranks``) that owns parameter ``i``'s
    state; ``member`` is this rank's index."""

    world: World
    member: int
    owners: tuple[int, ...]
    mine: tuple[int, ...] = ()  # the indices of the parameters ``member`` owns

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.world[1]

    @property
    def size(self) -> int:
        return len(self.world[1])

    def owns(self, index: int) -> bool:
        return self.owners[index] == self.member


class ParamFlat:
    """One bucket's trainable parameters in a flat tensor laid out by owner; each parameter's ``.data`` is its
    view of it, so an owner's updates are its segment of the flat, broadcast in place."""

    __slots__ = ("flat", "layout", "name", "ptrs")

    def __init__(self, lay: ShardLayout, params: Sequence[torch.Tensor], name: str) -> None:
        self.layout = lay
        self.name = name
        self.flat = torch.empty(lay.numel, dtype=lay.dtype, device=lay.device)
        self.ptrs = [0] * len(lay.params)
        for k in range(len(lay.params)):
            self._bind(k, params)

    @torch.no_grad()
    def _bind(self, k: int, params: Sequence[torch.Tensor]) -> None:
        p = params[self.layout.params[k]]
        view = self.flat.narrow(0, self.layout.offsets[k], self.layout.numels[k])
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(p.shape)
        self.ptrs[k] = view.data_ptr()

    def rebind(self, params: Sequence[torch.Tensor]) -> None:
        """Put back into the flat any parameter whose storage was replaced since (``load_state_dict(assign=True)``,
        an optimizer that assigns ``p.data``): its current value is copied in and it becomes a view again."""
        for k, index in enumerate(self.layout.params):
            if params[index].data_ptr() != self.ptrs[k]:
                self._bind(k, params)

    def launch(self, ps: Any, ranks: Sequence[int]) -> list[Any]:
        """Broadcast every member's segment from that member, in place (one negotiation round)."""
        calls = [Call(Kind.BROADCAST, self.flat[start:stop], f"{self.name}.{m}", ps, root=ranks[m], inplace=True)
                 for m, (start, stop) in enumerate(self.layout.segments) if stop > start]
        return submit_many(calls)


class Distribution:
    """One step's parameter broadcasts: a flat goes as soon as every parameter this rank owns in it is updated."""

    def __init__(self, sharding: Sharding) -> None:
        self.sharding = sharding
        self.handles: list[Any] = []
        part = sharding.partition()
        self.left = [sum(1 for k in range(len(f.layout.params)) if f.layout.owners[k] == part.member)
                     for f in sharding.flats]
        self.sent = [False] * len(sharding.flats)
        self.flat_of = {index: f for f, flat in enumerate(sharding.flats) for index in flat.layout.params}

    def updated(self, indices: Sequence[int]) -> None:
        """This rank's parameters ``indices`` were just updated: send the flats that are complete."""
        for index in indices:
            f = self.flat_of.get(index)
            if f is not None:
                self.left[f] -= 1
                if self.left[f] == 0:
                    self._send(f)

    def _send(self, f: int) -> None:
        if self.sent[f]:
            return
        self.sent[f] = True
        s = self.sharding
        flat = s.flats[f]
        flat.rebind(s.params)
        part = s.partition()
        if part.size > 1:
            self.handles += flat.launch(s.process_set, part.ranks)

    def finish(self) -> None:
        """Send what is left, then wait for every broadcast."""
        for f in range(len(self.sent)):
            self._send(f)
        for handle in self.handles:
            handles.synchronize(handle)
        self.handles = []


class Sharding:
    """The partition, the parameter flats and the state moves of one sharded optimizer.

    Args:
        mode: ``"optimizer"`` or ``"gradients"``.
        optimizer: the wrapped optimizer (its ``state`` and ``param_groups``).
        params, names, groups: the optimizer's parameters, their names and explicit bucket groups (as the
            reducer has them).
        process_set: the members sharing the state.
        naming: the reducer's bucket names (the prefix of the broadcasts' names).
        load_entries: puts ``{parameter index: entry}`` into the optimizer's state (torch's casting), dropping the rest.
    """

    def __init__(self, mode: str, optimizer: Any, params: Sequence[torch.Tensor], names: Sequence[str],
                 groups: Sequence[int], process_set: Any, naming: BucketNames,
                 load_entries: Callable[[dict[int, Any]], None]) -> None:
        self.mode = mode
        self.optimizer = optimizer
        self.params = list(params)
        self.names = list(names)
        self.index_of = {name: i for i, name in enumerate(self.names)}
        self.position = {id(p): i for i, p in enumerate(self.params)}  # a parameter's index, by identity
        self.groups = list(groups)
        self.process_set = process_set
        self.naming = naming
        self.load_entries = load_entries
        self.flats: list[ParamFlat] = []
        self._partition: Partition | None = None
        self._flats_key: tuple[Any, ...] | None = None
        self._layout_generation = 0
        self._settled: World | None = None  # the world whose partition the state follows
        self._state_world: Place | None = None  # where the live state was owned (its world, this rank's member)
        self._commit: dict[str, Any] | None = None  # this rank's shard at the last elastic commit
        self._commit_world: Place | None = None
        self._spare: dict[str, Any] = {}  # the previous member's shard at the last commit

    # -- the partition --------------------------------------------------------------------------------
    def _caps(self) -> tuple[int, int]:
        knobs = runtime.state("a sharded DistributedOptimizer").knobs
        return int(knobs.first_bucket_mb * _MB), int(knobs.bucket_cap_mb * _MB)

    def partition(self) -> Partition:
        """The partition of the current world (computed at its first use)."""
        ps = self.process_set
        world = (runtime.world_generation(), tuple(ps.ranks))
        part = self._partition
        if part is not None and part.world == world:
            return part
        if not ps.included():
            raise ValueError(f"sharding: rank {runtime.rank()} is not a member of {ps!r}, whose members share this "
                             "optimizer's state; build the optimizer only on the members")
        specs = [ParamSpec(i, p.numel(), p.dtype, p.device, self.groups[i]) for i, p in enumerate(self.params)]
        owners = assign_owners(specs, len(world[1]), *self._caps())
        member = ps.rank()
        self._partition = part = Partition(world, member, owners, tuple(i for i, o in enumerate(owners) if o == member))
        self._layout_generation = 0  # names of a new world start afresh, as a process that joined it names them
        self._flats_key = None
        return part

    def owned(self) -> tuple[int, ...]:
        """Indices of the parameters this rank owns."""
        return self.partition().mine

    def trainable_plans(self, caps: tuple[int, int] | None = None) -> list[Any]:
        """Buckets of the parameters that require grad now (``plan_buckets``' order; ``caps``: (first, later)
        bucket bytes, default the knobs')."""
        specs = [ParamSpec(i, p.numel(), p.dtype, p.device, self.groups[i])
                 for i, p in enumerate(self.params) if p.requires_grad and p.numel() > 0]
        return list(plan_buckets(specs, *(caps or self._caps())))

    def ensure_flats(self) -> None:
        """(Re)lay out the trainable parameters by owner when the world or the trainable set changed."""
        part = self.partition()
        key = (part.world, tuple(p.requires_grad for p in self.params))
        if key == self._flats_key:
            return
        self._flats_key = key
        prefix = f"{self.naming.prefix}.w{self._layout_generation}.params"
        self._layout_generation += 1
        self.flats = []  # the old flats are freed once their parameters are views of the new ones
        for b, plan in enumerate(self.trainable_plans()):
            self.flats.append(ParamFlat(layout(plan, part.owners, part.size), self.params, f"{prefix}.{b}"))

    def begin_step(self) -> Distribution:
        self.settle()
        self.ensure_flats()
        return Distribution(self)

    # -- the state ------------------------------------------------------------------------------------
    def held(self) -> dict[str, Any]:
        """Every entry of the optimizer's state, by parameter name, whoever owns it now."""
        state = self.optimizer.state
        return {self.names[i]: state[p] for i, p in enumerate(self.params) if p in state and state[p]}

    def owned_entries(self) -> dict[str, Any]:
        """This rank's owned entries (the optimizer's own dicts, not copies)."""
        state = self.optimizer.state
        return {self.names[i]: state[self.params[i]] for i in self.owned()
                if self.params[i] in state and state[self.params[i]]}

    def load(self, entries: dict[str, Any]) -> None:
        """Make ``entries`` (by name; extra names ignored) the state of the parameters this rank owns."""
        self.load_entries({i: entries[self.names[i]] for i in self.owned() if self.names[i] in entries})
        self.loaded()

    def loaded(self) -> None:
        """The optimizer's state was just loaded for this world's partition: nothing to settle."""
        part = self.partition()
        self._settled = part.world
        self._state_world = (part.world, part.member)

    def gather_all(self) -> dict[str, Any]:
        """Collective: every entry of the whole state, on every rank (a full ``state_dict()``)."""
        self.settle()
        got, _ = state_exchange.exchange(self.owned_entries(), self.names, name=f"{self.naming.prefix}.gather",
                                         process_set=self.process_set)
        return got

    def settle(self) -> None:
        """Collective at the first use in a world: move every entry to its owner in this world's partition
        (from the rank holding it live, or else from the elastic commit's copy on another rank)."""
        part = self.partition()
        if self._settled == part.world:
            return
        spare = self._spare if self._commit_world is not None else {}
        extra = (self._state_world, self._commit_world if spare else None, bool(self.optimizer.state))
        want = [self.names[i] for i in self.owned()]
        got, offers = state_exchange.exchange(self.held(), want, spare=spare, extra=extra,
                                              name=f"{self.naming.prefix}.settle", process_set=self.process_set)
        _check_nothing_lost(offers)
        before = self._state_world
        self.load(got)
        if before is not None and before[0] != part.world:
            log.info("%s: sharded optimizer state re-partitioned over %d ranks", self.naming.prefix, part.size)

    # -- gradients ------------------------------------------------------------------------------------
    def grad_norm(self, norm_type: float) -> torch.Tensor:
        """Collective: the norm of every parameter's reduced gradient, from the gradients each rank owns
        (``sharding="gradients"`` keeps no other): the owned norms' p-th powers summed over the ranks (their
        maximum for the inf norm). The same value on every rank."""
        grads = [g for g in (self.params[i].grad for i in self.owned()) if g is not None]
        device = grads[0].device if grads else self.params[0].device
        local = (torch.nn.utils.get_total_norm(grads, norm_type) if grads
                 else torch.zeros((), device=device)).to(torch.float32)
        name = f"{self.naming.prefix}.grad_norm"
        if math.isinf(norm_type):
            return ops.allreduce(local.reshape(1), name=name, op=ReduceOp.MAX, process_set=self.process_set)[0]
        total = ops.allreduce(local.reshape(1).pow(norm_type), name=name, op=ReduceOp.SUM,
                              process_set=self.process_set)
        return total[0].pow(1.0 / norm_type)

    def overflow_anywhere(self) -> bool:
        """Collective: whether some rank's owned reduced gradients hold an inf or NaN (a GradScaler's check,
        agreed over the ranks)."""
        grads = [g for g in (self.params[i].grad for i in self.owned()) if g is not None]
        device = grads[0].device if grads else self.params[0].device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        one = torch.ones((), dtype=torch.float32, device=device)
        for (dev, _), same in by_kind.items():
            flag = torch.zeros(1, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(same, flag, one.to(dev))  # unscale by 1: a check
            found += flag.to(device)
        found = ops.allreduce(found, name=f"{self.naming.prefix}.found_inf", op=ReduceOp.MAX,
                              process_set=self.process_set)
        return bool(found.item() > 0)

    def overflow_marker(self) -> torch.Tensor:
        """A tensor whose gradient is not finite, for a GradScaler to find (never stepped)."""
        marker = torch.zeros(1, device=self.params[0].device)
        marker.grad = torch.full((1,), float("inf"), device=marker.device)
        return marker

    # -- elastic commits ------------------------------------------------------------------------------
    def snapshot(self, copy_into: Callable[[Any, Any], Any]) -> None:
        """Keep a copy of the state this rank holds now, without a collective (an elastic state being built:
        a new worker builds it before it joins the job's world)."""
        held = self.held()
        self._commit = copy_into(self._commit, held)
        self._commit_world = self._state_world if held else None

    def commit(self, copy_into: Callable[[Any, Any], Any]) -> None:
        """Collective (an elastic ``commit()``): keep a copy of this rank's shard, and of the previous member's
        (sent here), so the state survives any one rank leaving before the next commit."""
        self.settle()
        part = self.partition()
        own = self.owned_entries()
        self._commit = copy_into(self._commit, own)
        self._commit_world = (part.world, part.member)
        self._spare = state_exchange.shift(own, name=f"{self.naming.prefix}.commit", process_set=self.process_set)

    def restore(self) -> None:
        """Put back the state this rank held at the last commit (no collective; the next settle moves it).
        A rank that held nothing then (it joined since) drops what it holds now."""
        entries = copy.deepcopy(self._commit) if self._commit else {}  # training on must not change the commit
        self.load_entries({self.index_of[name]: entry for name, entry in entries.items()})
        self._state_world = self._commit_world if entries else None
        self._settled = None


def _check_nothing_lost(offers: list[state_exchange.Offer]) -> None:
    """Raise on every member when a member of the world the state was last partitioned in left with its
    shard and no copy of it survived."""
    lives = [o.extra[0] for o in offers if o.extra and o.extra[0] is not None]
    if not lives or not any(o.extra and o.extra[2] for o in offers):
        return  # no state anywhere yet (or only state loaded in this world): nothing can be lost
    last = max(world for world, _ in lives)  # the most recent world any live state follows
    members = len(last[1])
    covered = {member for world, member in lives if world == last}
    # a commit's copy on member m is member m-1's shard (state_exchange.shift)
    covered |= {(o.extra[1][1] - 1) % members for o in offers
                if o.extra and o.extra[1] is not None and o.extra[1][0] == last}
    lost = sorted(set(range(members)) - covered)
    if lost:
        ranks = [last[1][m] for m in lost]
        raise ShardStateLostError(
            f"the sharded optimizer state of rank(s) {ranks} of the previous world was lost: they left with "
            "their shard, and so did the rank that kept a copy of it at the last commit. Resume from a "
            "checkpoint (hora.checkpoint), or commit more often")
