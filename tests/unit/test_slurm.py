"""Slurm's compact forms (hora.common.slurm): node lists and tasks per node, as the worker reads them."""

from __future__ import annotations

import pytest

from hora.common.slurm import expand_nodelist, parse_tasks_per_node
from hora.errors import ConfigError


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack1-[1-2]-ib", ["rack1-1-ib", "rack1-2-ib"]),
    ("solo", ["solo"]),
    ("a[1,3],b[2-3]", ["a1", "a3", "b2", "b3"]),
    ("", []),
])
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_parse_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("two")
