"""Where every rank sits: pure functions over the list of each rank's host, plus the record init() keeps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """This process's place in the job, and every rank's host (for reports)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostnames: tuple[str, ...]  # hostnames[r] = host name of rank r, for messages
    homogeneous: bool  # every host runs the same number of ranks
    hosts: tuple[tuple[int, ...], ...] = ()  # the ranks on each host, hosts in order of first appearance


def derive_topology(host_keys: list[str], hostnames: list[str], rank: int) -> Topology:
    """Local and cross ranks as Horovod assigns them, from each rank's host key.

    local_rank = index of the rank among the ranks on its host (in rank order); cross_rank = index of its host
    among the hosts that have a rank with that local_rank (in order of first appearance).

    >>> t = derive_topology(["a", "a", "b", "b"], ["a", "a", "b", "b"], 3)
    >>> (t.local_rank, t.local_size, t.cross_rank, t.cross_size)
    (1, 2, 1, 2)
    """
    hosts_in_order = list(dict.fromkeys(host_keys))
    ranks_on: dict[str, list[int]] = {h: [] for h in hosts_in_order}
    for r, h in enumerate(host_keys):
        ranks_on[h].append(r)
    mine = host_keys[rank]
    local_rank = ranks_on[mine].index(rank)
    peers = [h for h in hosts_in_order if len(ranks_on[h]) > local_rank]
    counts = {len(v) for v in ranks_on.values()}
    return Topology(
        rank=rank,
        size=len(host_keys),
        local_rank=local_rank,
        local_size=len(ranks_on[mine]),
        cross_rank=peers.index(mine),
        cross_size=len(peers),
        hostnames=tuple(hostnames),
        homogeneous=len(counts) == 1,
        hosts=tuple(tuple(ranks_on[h]) for h in hosts_in_order),
    )
