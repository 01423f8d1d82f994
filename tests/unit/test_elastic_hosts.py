"""Elastic host discovery and the blacklist (hora.launcher.elastic.hosts)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hora.errors import ConfigError
from hora.launcher.elastic.hosts import (
    Absences,
    Discovery,
    DiscoveryError,
    HostManager,
    parse_discovery_output,
    run_discovery,
)
from hora.launcher.hosts import HostSpec, parse_hosts
from tests.launcher.helpers import alive
from tests.polling import wait_until


def test_discovery_output_lines() -> None:
    assert parse_discovery_output("a:2\n\n  b  # spare\n[fe80::1]:3\n", None, "d") == (
        HostSpec("a", 2), HostSpec("b", 1), HostSpec("[fe80::1]", 3))
    assert parse_discovery_output("a\nb:1\n", 4, "d") == (HostSpec("a", 4), HostSpec("b", 1))  # --slots-per-host
    assert parse_discovery_output("", None, "d") == ()
    with pytest.raises(ConfigError, match="printed twice"):
        parse_discovery_output("a:1\na:2\n", None, "d")
    with pytest.raises(ConfigError, match="output line 2: slot count 'x'"):
        parse_discovery_output("a:1\nb:x\n", None, "d")


def test_run_discovery_reports_a_failing_script(tmp_path: Path) -> None:
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho a:2\necho b\n")
    script.chmod(0o755)
    assert run_discovery(str(script), 3) == (HostSpec("a", 2), HostSpec("b", 3))
    script.write_text("#!/bin/sh\necho 'no cloud credentials' >&2\nexit 4\n")
    with pytest.raises(DiscoveryError, match="exit code 4: no cloud credentials"):
        run_discovery(str(script), None)
    with pytest.raises(DiscoveryError, match="did not finish within 0.2s"):
        run_discovery("sleep 5", None, timeout=0.2)


def _wait_gone(pid: int) -> bool:
    return wait_until(lambda: not alive(pid), timeout=10)


def test_a_discovery_script_that_times_out_is_killed_with_every_process_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    # the shell starts a slow call (an API client) and waits for it; the call must not outlive the timeout
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    with pytest.raises(DiscoveryError, match=r"did not finish within 0.5s \(it was killed, with every process it "
                                             r"started\)"):
        run_discovery(script, None, timeout=0.5)
    assert _wait_gone(int(pid_file.read_text()))


def test_a_discovery_run_in_progress_is_killed_when_the_job_ends(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    discovery = Discovery(f"sleep 300 & echo $! > {pid_file}; wait", None, timeout=300)
    failed: list[str] = []

    def run() -> None:
        try:
            discovery.run()
        except DiscoveryError as exc:
            failed.append(str(exc))

    runner = threading.Thread(target=run)
    runner.start()
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=10)
    discovery.stop()
    runner.join(10)
    assert not runner.is_alive() and failed and "exit code -9" in failed[0]
    assert _wait_gone(int(pid_file.read_text()))


def test_a_host_is_removed_once_two_answers_in_a_row_leave_it_out() -> None:
    seen = Absences()
    assert seen.look({"a"}, ["a", "b"]) == []  # one short answer
    assert seen.look({"a", "b"}, ["a", "b"]) == []  # listed again: forgotten
    assert seen.look({"a"}, ["a", "b"]) == []
    assert seen.look(set(), ["a", "b"]) == ["b"]  # b: second answer in a row; a: first
    assert seen.look(set(), ["a"]) == ["a"]


def test_added_and_removed_hosts() -> None:
    hm = HostManager(cooldown=None)
    assert hm.update(parse_hosts("a:2,b:2")) == (["a", "b"], [])
    assert hm.update(parse_hosts("b:2,c:1")) == (["c"], ["a"])
    assert [h.name for h in hm.available(now=0.0)] == ["b", "c"]


def test_blacklist_for_good_without_a_cooldown() -> None:
    hm = HostManager(cooldown=None)
    hm.update(parse_hosts("a:1,b:1"))
    assert hm.blacklist("a", now=0.0) == float("inf")
    assert [h.name for h in hm.available(now=1e9)] == ["b"]
    assert not hm.all_blacklisted_for_good(now=1.0)
    hm.blacklist("b", now=0.0)
    assert hm.all_blacklisted_for_good(now=1.0) and hm.cooling(now=1.0) == []


def test_cooldown_doubles_per_failure_up_to_the_maximum() -> None:
    hm = HostManager(cooldown=(10.0, 60.0), rng=lambda: 0.0)
    hm.update(parse_hosts("a:1"))
    assert [hm.blacklist("a", now=0.0) for _ in range(4)] == [10.0, 20.0, 40.0, 60.0]
    assert hm.cooling(now=59.0) == ["a"] and hm.available(now=59.0) == []
    assert [h.name for h in hm.available(now=60.0)] == ["a"]  # back after its cooldown
    jittered = HostManager(cooldown=(10.0, 60.0), rng=lambda: 1.0)
    assert jittered.blacklist("a", now=0.0) == 12.5  # up to 25 % more, so hosts that failed together spread out
