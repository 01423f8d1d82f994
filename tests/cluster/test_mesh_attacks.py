"""A stranger on the cluster network against a 2-host job's control mesh, and a host running different hora
code: what the issue's attacker did (issue 23) now runs nothing, delays nothing, and is named.

The attacker (tests/cluster/mesh_attack.py) runs on node2, the login host, with nothing but TCP; its sniffer
watches node4's cable from the hub (a mirrored switch port). The job's ranks are slowed at chosen points
(tests/cluster/mesh_attack_worker.py) so that every attack meets every listener while it is open.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hora.engine.auth.listener import HANDSHAKE_S
from hora.protocol.jobsecret import JobSecret
from tests.cluster import jobs, netns
from tests.polling import wait_until

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
ATTACKER = str(HERE / "mesh_attack.py")
WORKER = str(HERE / "mesh_attack_worker.py")
STRANGER = "10.78.0.2"


@pytest.fixture
def sniffer(hosts: netns.Cluster, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Capture the first control handshake from node4 (rank 2) to node3 (rank 0), on node4's cable."""
    proc = subprocess.Popen(["ip", "netns", "exec", hosts.hub, sys.executable, ATTACKER, "sniff", "v4", "10.78.0.4",
                             "10.78.0.3", str(tmp_path)], stdin=subprocess.DEVNULL)
    try:
        started = tmp_path / "sniffing"
        assert wait_until(started.exists, timeout=30, step=0.05, unless=lambda: proc.poll() is not None), (
            f"the sniffer did not start (exit {proc.poll()})")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_stranger_on_the_network_cannot_join_stall_or_run_code_in_the_mesh(
        hosts: netns.Cluster, tmp_path: Path, sniffer: subprocess.Popen[bytes]) -> None:
    canary = tmp_path / "canary"
    secret = tmp_path / "job.secret"  # as under an external launcher: the ranks read it, the attacker cannot
    secret.write_text(JobSecret.generate().hex())
    secret.chmod(0o600)
    attacker = hosts.host(2).popen([sys.executable, ATTACKER, "attack", str(tmp_path), str(canary)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        flags = ["-np", "4", "-H", "10.78.0.3:2,10.78.0.4:2", "-x", f"HORA_SECRET_FILE={secret}",
                 *jobs.hora_ssh_flags(hosts)]
        code, job = jobs.run_job(hosts, flags, [jobs.PYTHON, WORKER, str(tmp_path)], tmp_path, timeout=240)
        if code != 0:  # the attacker may still wait for what a failed job never wrote: the job's failure is the news
            attacker.kill()
        out, err = attacker.communicate(timeout=60)
    finally:
        attacker.kill()
    assert code == 0, job.describe() + f"\n--- attacker ---\n{err[-3000:]}"
    assert not canary.exists(), "the attacker's pickled payload ran"
    reports = jobs.worker_reports(job.stdout)
    assert [r["sum"] for r in reports] == [10.0] * 4, job.describe()  # 1 + 2 + 3 + 4: exact
    outcomes = json.loads((tmp_path / "outcomes.json").read_text())

    # a captured handshake replayed to its listener while the real rank's seat was free: the nonce differs
    assert outcomes["replay"] == "listener answered [1, 2], then refused: the proof does not match", outcomes
    for rank in (0, 1, 2):  # every listener of the mesh (rank 3 listens for nobody)
        seen = outcomes[f"rank{rank}"]
        assert seen["impersonate"] == "answered [1, 2], then refused: the proof does not match", seen
        # before its proof, nothing a stranger says fails the listener: not even "another wire version"
        assert seen["other version after hello"] == ("answered [1, 2], then refused: it (claiming rank 3) speaks "
                                                     "control wire version 99, this rank wire version 1: install "
                                                     "the same hora on every host"), seen
        for attack in ("old protocol with a pickle", "garbage", "oversized", "forged frame"):
            assert seen[attack] == "closed", (attack, seen)

    # each refused connection is one line naming the stranger's address, and the real ranks connected while
    # all 50 half-open connections on every listener were still waiting
    lines = job.stdout + job.stderr
    for rank in (0, 1, 2):
        refused = re.findall(rf"rank {rank}: closed a mesh connection from {STRANGER}:\d+ that failed the handshake: "
                             r"(.*)", lines)
        assert len(refused) >= 5, (rank, refused, job.describe())
        assert f"rank {rank}: closed 50 mesh connection(s) that had not completed a handshake when every rank was " \
               f"connected (from {STRANGER})" in lines, job.describe()
    assert re.search(rf"rank 0: closed a mesh connection from {STRANGER}:\d+ that failed the handshake: it claimed "
                     "rank 2 but could not prove", lines), job.describe()
    assert "must reach each other" not in lines, job.describe()

    # rank 3 connected to three listeners under attack: a listener serving connections one at a time would have
    # kept it waiting a full handshake deadline per stray ahead of it
    mesh_s = next(r["mesh_s"] for r in reports if r["rank"] == 3)
    assert mesh_s < HANDSHAKE_S / 2, f"rank 3's connections took {mesh_s:.2f} s under attack"
    assert jobs.leftovers(hosts, within=10) == {}


@pytest.fixture
def changed_hora_file(hosts: netns.Cluster, tmp_path: Path) -> Iterator[Path]:
    """On node4 only, one of hora's files differs (a copy with one more line, bind-mounted over it): the same
    version string, different code, as after a local edit or another build."""
    import hora.engine.codec as target

    real = Path(target.__file__).resolve()
    changed = tmp_path / real.name
    changed.write_text(real.read_text() + "\n# changed on this host only\n")
    node4 = hosts.host(4)
    node4.run(["mount", "--bind", str(changed), str(real)], check=True)
    try:
        yield real
    finally:
        node4.run(["umount", str(real)], check=True)


def test_a_host_running_different_hora_code_is_refused_in_preflight(
        hosts: netns.Cluster, tmp_path: Path, changed_hora_file: Path) -> None:
    flags = ["-np", "4", "-H", "10.78.0.3:2,10.78.0.4:2", *jobs.hora_ssh_flags(hosts)]
    code, job = jobs.run_job(hosts, flags, jobs.worker("report"), tmp_path, timeout=60)
    assert code == 2, job.describe()
    problems = re.findall(r"^hora run: error: (host \S+: .*)$", job.stderr, re.MULTILINE)
    assert len(problems) == 1 and problems[0].startswith("host 10.78.0.4: hora "), job.describe()
    assert "there is different code from the launcher's hora" in problems[0], problems
    assert re.search(r"\(code fingerprint [0-9a-f]{12} there, [0-9a-f]{12} here\)", problems[0]), problems
    assert "<stdout>" not in job.stdout + job.stderr, job.describe()  # nothing started
    assert jobs.leftovers(hosts, within=5) == {}
