"""A stranger on the path between two hosts of a job changes the bytes of a ``broadcast_object`` on the Gloo data
plane (issue 33.3): torch's data plane carries no authentication, so hora must never unpickle what arrives
there unchecked. Before the check the stranger's pickle ran in the receiving rank.

The job: rank 0 on node2, rank 1 on node3. The stranger on node4: the two hosts' routes to each other go through
it (as ARP spoofing would make them), and it relays every connection (tests/cluster/data_plane_attack.py),
rewriting the first bytes of the object rank 0 sends.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import jobs, netns
from tests.polling import wait_until

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
RELAY_PORT = 47000
N2, N3, N4 = "10.78.0.2", "10.78.0.3", "10.78.0.4"


@pytest.fixture
def on_path(hosts: netns.Cluster, tmp_path: Path) -> Iterator[Path]:
    """node2 <-> node3 traffic through node4's relay; undone afterwards, whatever happened."""
    where = tmp_path / "stranger"
    where.mkdir()
    n2, n3, n4 = hosts.host(2), hosts.host(3), hosts.host(4)
    relay = n4.popen([sys.executable, str(HERE / "data_plane_attack.py"), str(RELAY_PORT), str(where), N2],
                     stdout=subprocess.DEVNULL, stderr=open(where / "relay.err", "w"))  # noqa: SIM115
    redirects = [["-s", N3, "-d", N2], ["-s", N2, "-d", N3]]
    try:
        assert wait_until((where / "relaying").exists, timeout=30, step=0.05), (where / "relay.err").read_text()
        for rule in redirects:
            n4.run(["iptables", "-t", "nat", "-A", "PREROUTING", "-p", "tcp", *rule, "-j", "REDIRECT", "--to-ports",
                    str(RELAY_PORT)], check=True)
        n3.run(["ip", "route", "add", f"{N2}/32", "via", N4], check=True)
        n2.run(["ip", "route", "add", f"{N3}/32", "via", N4], check=True)
        yield where
    finally:
        n3.run(["ip", "route", "del", f"{N2}/32"])
        n2.run(["ip", "route", "del", f"{N3}/32"])
        for rule in redirects:
            n4.run(["iptables", "-t", "nat", "-D", "PREROUTING", "-p", "tcp", *rule, "-j", "REDIRECT", "--to-ports",
                    str(RELAY_PORT)])
        relay.kill()
        relay.wait()


def test_a_forged_gloo_payload_into_broadcast_object_runs_no_code(
        hosts: netns.Cluster, tmp_path: Path, on_path: Path) -> None:
    flags = ["-np", "2", "-H", f"{N2}:1,{N3}:1", *jobs.hora_ssh_flags(hosts)]
    code, job = jobs.run_job(hosts, flags, [jobs.PYTHON, str(HERE / "object_worker.py")], tmp_path, timeout=180)
    canaries = [p.read_text() for p in on_path.glob("canary.*")]
    assert not canaries, f"the stranger's pickle ran: {canaries}\n{job.describe()}"
    relayed = (on_path / "relayed").read_text() if (on_path / "relayed").exists() else ""
    assert f"-> {N2}:" in relayed or f"-> {N3}:" in relayed, "no connection went through the stranger"
    tampered = (on_path / "tampered").read_text() if (on_path / "tampered").exists() else ""
    assert tampered, f"the stranger never saw the object's bytes\n{relayed}\n{job.describe()}"
    reports = {r["rank"]: r for r in jobs.worker_reports(job.stdout)}
    assert code == 0, job.describe()
    assert reports[0]["keys"] == ["exp_avg", "note", "step"], reports  # the root keeps its own object
    assert re.fullmatch(r"ObjectAuthError: broadcast_object 'state': the bytes of rank 0's object failed "
                        r"authentication and were not unpickled: they were changed on the way, or sent by a process "
                        r"without this job's secret \(a stranger on the data plane's network: run the job on a "
                        r"network of its own, see docs/security\.md\)", reports[1]["error"]), reports
    left = jobs.leftovers(hosts, within=10)
    assert {h: [p for p in procs if "data_plane_attack.py" not in p] for h, procs in left.items()} == \
        {h: [] for h in left}, left  # the stranger's relay is the fixture's to stop
