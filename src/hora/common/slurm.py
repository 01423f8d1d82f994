"""Slurm's compact host and task lists, expanded (pure text parsing, for :mod:`hora.common.env`'s Slurm detection).

Example:
    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> parse_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import re

from hora.errors import ConfigError


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm nodelist such as ``node[01-03,07],gpu5`` into host names."""
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)", nodelist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) into one count per node."""
    counts: list[int] = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={spec!r}: cannot parse {item!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
