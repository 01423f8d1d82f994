"""Where a :class:`hora.ray.RayExecutor`'s ranks run: the placement group that reserves them, and each rank's
place (local and cross ranks, by Ray node) as the variables ``hvd.init()`` reads.

The layout is a pure function of every rank's Ray node, so it is tested without Ray:

    >>> envs = rank_environments(["n1", "n2", "n1"], ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "10.0.0.1", 29501)
    >>> envs[2]["HOROVOD_LOCAL_RANK"], envs[2]["HOROVOD_LOCAL_SIZE"], envs[1]["HOROVOD_CROSS_RANK"]
    ('1', '2', '1')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group

from hora.errors import PlacementTimeoutError
from hora.protocol.topology import derive_topology


@dataclass(frozen=True, kw_only=True, slots=True)
class Reservation:
    """The placement group the ranks run in; ``bundles[r]`` is rank r's bundle index (-1: any)."""

    group: PlacementGroup
    bundles: tuple[int, ...]
    owned: bool  # made by the executor (removed at shutdown), not the caller's current group


def reserve(*, num_workers: int | None, num_hosts: int | None, num_workers_per_host: int, cpus_per_worker: float,
            gpus_per_worker: float, use_current: bool, timeout_s: float) -> Reservation:
    """Reserve every rank's CPUs and GPUs at once, or fail naming what the cluster lacks.

    ``num_workers``: one bundle per rank, packed onto as few nodes as fit (Ray's PACK). ``num_hosts``: one bundle
    per host holding ``num_workers_per_host`` ranks, each bundle on a different node (STRICT_SPREAD). Inside a
    placement group (e.g. a Ray Tune trial) with ``use_current``, the ranks run in that group instead.
    """
    current = get_current_placement_group() if use_current else None
    if current is not None and num_workers is not None:
        return Reservation(group=current, bundles=(-1,) * num_workers, owned=False)
    per_worker = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    if num_hosts is not None:
        bundle = {k: v * num_workers_per_host for k, v in per_worker.items()}
        group = ray.util.placement_group([dict(bundle) for _ in range(num_hosts)], strategy="STRICT_SPREAD")
        ranks = tuple(h for h in range(num_hosts) for _ in range(num_workers_per_host))
    else:
        assert num_workers is not None
        group = ray.util.placement_group([dict(per_worker) for _ in range(num_workers)], strategy="PACK")
        ranks = tuple(range(num_workers))
    hosts = f" on {num_hosts} different nodes" if num_hosts is not None else ""
    _wait_ready(group, timeout_s, f"hora.ray: the cluster could not place {len(ranks)} ranks of {per_worker}{hosts} "
                f"within {timeout_s:.0f} s (available now: {{available}}); add nodes, ask for fewer workers or "
                "resources per worker, or raise placement_group_timeout_s in create_settings()")
    return Reservation(group=group, bundles=ranks, owned=True)


def _wait_ready(group: PlacementGroup, timeout_s: float, message: str) -> None:
    """Wait for ``group``'s bundles to be reserved; else remove it and raise ``message`` (``{available}``: what the
    cluster has free now) as a :class:`PlacementTimeoutError`, a ``TimeoutError``."""
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise PlacementTimeoutError(message.replace("{available}", str(ray.available_resources())))


def create_placement_group(resources_per_bundle: dict[str, float], num_bundles: int, pg_timeout: float,
                           pg_strategy: str) -> tuple[PlacementGroup, list[dict[str, float]]]:
    """Horovod's ``horovod.ray.strategy.create_placement_group``: ``num_bundles`` bundles of
    ``resources_per_bundle`` with Ray's ``pg_strategy`` (``PACK``, ``SPREAD``...), ready within ``pg_timeout`` s.

    Returns:
        ``(placement group, bundles)``.

    Raises:
        PlacementTimeoutError: (a ``TimeoutError``, as Horovod's) the cluster could not reserve them in time.
    """
    bundles = [dict(resources_per_bundle) for _ in range(num_bundles)]
    group = ray.util.placement_group(bundles, strategy=pg_strategy)
    _wait_ready(group, pg_timeout, f"hora.ray: the cluster could not reserve {num_bundles} bundles of "
                f"{resources_per_bundle} ({pg_strategy}) within {pg_timeout:g} s (available now: {{available}}); "
                "add nodes or ask for less")
    return group, bundles


class Coordinator:
    """Horovod's ``horovod.ray.runner.Coordinator``: each rank registers its node; :meth:`finalize_registration`
    gives every rank its local and cross place by node (Horovod's numbering, as ``hora run`` assigns it:
    :func:`hora.protocol.topology.derive_topology`). ``settings`` is kept for Horovod's sake."""

    def __init__(self, settings: Any = None) -> None:
        self.settings = settings
        self.node_id_by_rank: dict[str, list[int]] = {}
        self._hostnames: set[str] = set()

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.node_id_by_rank.values())

    @property
    def hostnames(self) -> set[str]:
        return self._hostnames

    @property
    def node_id_string(self) -> str:
        """``"node:ranks,..."``, as Horovod's host string."""
        return ",".join(f"{node}:{len(ranks)}" for node, ranks in self.node_id_by_rank.items())

    def register(self, hostname: str, node_id: str, world_rank: int) -> None:
        self._hostnames.add(hostname)
        self.node_id_by_rank.setdefault(node_id, []).append(world_rank)

    def finalize_registration(self) -> dict[int, dict[str, int]]:
        """``{world rank: {HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE}}``."""
        node_of = {rank: node for node, ranks in self.node_id_by_rank.items() for rank in ranks}
        ranks = sorted(node_of)
        keys = [node_of[r] for r in ranks]
        info = {}
        for i, rank in enumerate(ranks):
            t = derive_topology(keys, keys, i)
            info[rank] = {"HOROVOD_CROSS_RANK": t.cross_rank, "HOROVOD_CROSS_SIZE": t.cross_size,
                          "HOROVOD_LOCAL_RANK": t.local_rank, "HOROVOD_LOCAL_SIZE": t.local_size}
        return info


def rank_environments(node_ids: list[str], node_ips: list[str], store_addr: str, store_port: int,
                      ) -> list[dict[str, str]]:
    """Each rank's variables: rank, size, local/cross rank and size by Ray node (a Ray node is a host, even when
    several run on one machine), a host name that tells nodes apart, and the store rank 0 serves."""
    names = [f"{ip}/{node[:8]}" for node, ip in zip(node_ids, node_ips)]
    envs = []
    for rank in range(len(node_ids)):
        topo = derive_topology(node_ids, names, rank)
        envs.append({
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(topo.size),
            "HOROVOD_LOCAL_RANK": str(topo.local_rank), "HOROVOD_LOCAL_SIZE": str(topo.local_size),
            "HOROVOD_CROSS_RANK": str(topo.cross_rank), "HOROVOD_CROSS_SIZE": str(topo.cross_size),
            "HOROVOD_HOSTNAME": names[rank], "MASTER_ADDR": store_addr, "MASTER_PORT": str(store_port),
        })
    return envs


def visible_devices(node_ids: list[str], gpu_ids: list[list[Any]]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for each rank: every GPU Ray gave the ranks of its node, in local-rank order, so
    local rank i uses device i and peers on the node can reach each other's devices (NCCL's fast paths)."""
    on_node: dict[str, list[str]] = {}
    for node, ids in zip(node_ids, gpu_ids):
        on_node.setdefault(node, []).extend(str(i) for i in ids)
    return [",".join(on_node[node]) for node in node_ids]
