"""The launcher's checks before it starts anything (hora.launcher.remote.preflight): one machine listed twice."""

from __future__ import annotations

import pytest

from hora.errors import LaunchError
from hora.launcher.hosts import HostSpec
from hora.launcher.remote import preflight


def test_one_machine_listed_twice_is_refused_and_different_machines_pass() -> None:
    hosts = (HostSpec("localhost", 1), HostSpec("127.0.0.1", 1))
    with pytest.raises(LaunchError, match=r"hosts localhost and 127\.0\.0\.1 are the same machine \(this machine\)"):
        preflight.refuse_same_machine(hosts, {"localhost", "127.0.0.1"}, {})
    remote = (HostSpec("a", 1), HostSpec("10.0.0.1", 2), HostSpec("b", 1))
    answers = {"a": {"machine": "boot1/net:[1]"}, "10.0.0.1": {"machine": "boot1/net:[1]"},
               "b": {"machine": "boot2/net:[1]"}}
    with pytest.raises(LaunchError, match=r"hosts a and 10\.0\.0\.1 are the same machine: .* -H a:3$"):
        preflight.refuse_same_machine(remote, {"a", "10.0.0.1", "b"}, answers)
    preflight.refuse_same_machine(remote, {"a", "b"}, answers)  # -np left 10.0.0.1 without ranks
