"""``hora check -H`` over real ssh to the simulated hosts: one entry per host, reachability, agreement."""

from __future__ import annotations

import json
import sys

import pytest

from tests.cluster import netns

pytestmark = pytest.mark.cluster

CHECK = [sys.executable, "-m", "hora.launcher.check"]


def test_check_answers_for_every_host_and_names_the_unreachable_one(hosts: netns.Cluster) -> None:
    login, gone = hosts.host(2), hosts.host(4)
    spec = ",".join(f"{h.addr}:2" for h in hosts.hosts)
    gone.link_down()
    try:
        out = login.run([*CHECK, "-H", spec, "--ssh-config-file", str(hosts.ssh_config), "--json"], timeout=120)
    finally:
        gone.link_up()
    assert out.returncode == 1, out.stderr  # not every host answered
    report = json.loads(out.stdout)
    up = [h for h in hosts.hosts if h is not gone]
    assert [(h["host"], h["reachable"], h.get("hostname")) for h in report["hosts"]] == [
        *((h.addr, True, h.hostname) for h in up),
        (gone.addr, False, None),
    ]
    for h, info in zip(up, report["hosts"]):
        eth0 = [i for i in info["interfaces"] if i["name"] == "eth0"]
        assert eth0 and any(a.startswith(h.addr + "/") for a in eth0[0]["addresses"])
    assert report["hosts"][2]["error"].startswith(f"ssh: connect to host {gone.addr} port 22")
    assert report["disagree"] == {}  # the hosts that answered agree on hora, torch and Python
    assert report["ok"] is False
