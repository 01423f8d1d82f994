"""Host parsing and Horovod's rank assignment (pure functions)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hora.errors import ConfigError
from hora.launcher.hosts import HostSpec, assign_slots, parse_hostfile, parse_hostfile_text, parse_hosts


def test_hosts_with_and_without_slots_and_ipv6() -> None:
    assert parse_hosts("node1:4,node2,[fe80::1]:2,10.0.0.3:1") == (
        HostSpec("node1", 4), HostSpec("node2", 1), HostSpec("[fe80::1]", 2), HostSpec("10.0.0.3", 1))


def test_hostfile_formats_comments_and_blank_lines() -> None:
    text = "# cluster\n\nnode1 slots=2\nnode2:3   # fat node\n  node3  slots = 1 \nnode4\n"
    assert parse_hostfile_text(text, "hosts") == (
        HostSpec("node1", 2), HostSpec("node2", 3), HostSpec("node3", 1), HostSpec("node4", 1))


def test_hostfile_read_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a slots=1\nb slots=2\n")
    assert parse_hostfile(str(path)) == (HostSpec("a", 1), HostSpec("b", 2))


@pytest.mark.parametrize("name, local", [("localhost", True), ("127.0.0.1", True), ("127.0.1.1", True),
                                         ("[::1]", True), ("node1", False), ("10.78.0.2", False)])
def test_which_names_mean_this_machine(name: str, local: bool) -> None:
    assert HostSpec(name, 1).is_local is local


def test_this_machines_own_host_name_needs_no_ssh() -> None:
    assert HostSpec(socket.gethostname(), 2).is_local is True


def _table(hosts: str, np: int) -> list[tuple[int, str, int, int, int, int]]:
    return [(s.rank, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in assign_slots(parse_hosts(hosts), np)]


def test_ranks_fill_hosts_in_order_with_horovods_local_and_cross_ranks() -> None:
    assert _table("a:2,b:2", 4) == [
        (0, "a", 0, 2, 0, 2), (1, "a", 1, 2, 0, 2), (2, "b", 0, 2, 1, 2), (3, "b", 1, 2, 1, 2)]


def test_uneven_hosts_cross_rank_counts_only_hosts_with_that_local_rank() -> None:
    assert _table("a:3,b:1,c:2", 6) == [
        (0, "a", 0, 3, 0, 3), (1, "a", 1, 3, 0, 2), (2, "a", 2, 3, 0, 1),
        (3, "b", 0, 1, 1, 3), (4, "c", 0, 2, 2, 3), (5, "c", 1, 2, 1, 2)]


def test_np_caps_workers_even_when_hosts_offer_more_slots() -> None:
    assert _table("a:4,b:4", 3) == [(0, "a", 0, 3, 0, 1), (1, "a", 1, 3, 0, 1), (2, "a", 2, 3, 0, 1)]


def test_np_beyond_slots_is_refused() -> None:
    with pytest.raises(ConfigError, match="-np 9 is more than the 8 slots"):
        assign_slots(parse_hosts("a:4,b:4"), 9)
