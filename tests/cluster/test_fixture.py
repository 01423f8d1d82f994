"""The simulated hosts behave like separate machines: own address, hostname, processes and cable."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster import netns

pytestmark = pytest.mark.cluster


def test_ssh_reaches_every_host_with_its_own_hostname(hosts: netns.Cluster) -> None:
    login = hosts.host(2)
    for host in hosts.hosts:
        out = login.run(["ssh", *hosts.ssh_args, host.addr, "hostname"], timeout=30)
        assert (out.returncode, out.stdout.strip()) == (0, host.hostname), out.stderr
        resolved = login.run(["getent", "hosts", host.hostname]).stdout.split()
        assert resolved == [host.addr, host.hostname]


def test_ps_sees_a_process_only_on_its_own_host(hosts: netns.Cluster) -> None:
    sleeper = hosts.host(3).popen(["sleep", "300"], stdout=subprocess.DEVNULL)
    try:
        seen = {name: [p.cmdline for p in procs] for name, procs in hosts.ps().items()}
        assert "sleep 300" in seen["node3"]
        assert "sleep 300" not in seen["node2"] + seen["node4"]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert [p.cmdline for p in hosts.host(3).ps()] == []


def test_link_down_cuts_a_host_off_and_link_up_restores_it(hosts: netns.Cluster) -> None:
    login, target = hosts.host(2), hosts.host(4)
    ssh = ["ssh", *hosts.ssh_args, "-o", "ConnectTimeout=2", target.addr, "hostname"]
    target.link_down()
    cut = login.run(ssh, timeout=30)
    assert cut.returncode == 255
    target.link_up()
    back = login.run(ssh, timeout=30)
    assert (back.returncode, back.stdout.strip()) == (0, "node4")


def test_stale_namespaces_of_a_dead_builder_are_removed() -> None:
    if netns.missing_requirements() is not None:
        pytest.skip(netns.missing_requirements())
    dead_pid = 2**22 + 1  # above the kernel's PID_MAX_LIMIT (2**22): never a live pid
    name = f"hora{dead_pid}xdeadh9"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.clean_stale()
    finally:
        netns.delete_namespace(name)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert name not in listed
