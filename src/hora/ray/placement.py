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
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        hosts = f" on {num_hosts} different nodes" if num_hosts is not None else ""
        raise PlacementTimeoutError(
            f"hora.ray: the cluster could not place {len(ranks)} ranks of {per_worker}{hosts} within "
            f"{timeout_s:.0f} s (available now: {ray.available_resources()}); add nodes, ask for fewer "
            "workers or resources per worker, or raise placement_group_timeout_s in create_settings()")
    return Reservation(group=group, bundles=ranks, owned=True)


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
