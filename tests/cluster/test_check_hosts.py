"""``hora check -H`` over real ssh to the simulated hosts: one row per host, reachability, agreement."""

from __future__ import annotations

import json
import sys

import netns
import pytest

pytestmark = pytest.mark.cluster

CHECK = [sys.executable, "-m", "hora.diagnostics.check"]


def test_check_answers_for_every_host_and_names_the_unreachable_one(hosts: netns.Cluster) -> None:
    login = hosts.host(2)
    spec = ",".join(f"{h.addr}:2" for h in hosts.hosts)
    ssh = ["--ssh-config-file", str(hosts.ssh_config)]
    out = login.run([*CHECK, "-H", spec, *ssh, "--json"], timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [(h["host"], h["reachable"], h["hostname"]) for h in report["hosts"]] == [
        (h.addr, True, h.hostname) for h in hosts.hosts
    ]
    assert report["disagree"] == {} and report["ok"] is True
    for h, info in zip(hosts.hosts, report["hosts"]):
        eth0 = [i for i in info["interfaces"] if i["name"] == "eth0"]
        assert eth0 and any(a.startswith(h.addr + "/") for a in eth0[0]["addresses"])

    gone = hosts.host(4)
    gone.link_down()
    try:
        table = login.run([*CHECK, "-H", spec, *ssh], timeout=120)
    finally:
        gone.link_up()
    assert table.returncode == 1
    rows = {line.split()[0]: line.split()[1] for line in table.stdout.splitlines()[1:4]}
    assert rows == {hosts.host(2).addr: "yes", hosts.host(3).addr: "yes", gone.addr: "NO"}
    assert f"{gone.addr}: unreachable: " in table.stdout
    assert table.stdout.rstrip().endswith("NOT OK (see above)")
