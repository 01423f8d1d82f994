"""`hora run` across three hosts over ssh: ranks, topology, a real allreduce, nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import jobs, netns

pytestmark = pytest.mark.cluster

HOSTS = "10.78.0.2:2,10.78.0.3:2,10.78.0.4:2"


def test_six_ranks_on_three_hosts_allreduce_with_horovod_topology(hosts: netns.Cluster, tmp_path: Path) -> None:
    code, job = jobs.run_job(
        hosts, ["-np", "6", "-H", HOSTS, *jobs.hora_ssh_flags(hosts)], jobs.worker("report"), tmp_path
    )
    assert code == 0, job.describe()
    reports = jobs.worker_reports(job.stdout)
    seen = [(r["rank"], r["prefix_rank"], r["hostname"], r["local_rank"], r["cross_rank"]) for r in reports]
    # Ranks fill hosts in order; local rank = index on the host; cross rank = index of the host.
    assert seen == [
        (0, 0, "node2", 0, 0),
        (1, 1, "node2", 1, 0),
        (2, 2, "node3", 0, 1),
        (3, 3, "node3", 1, 1),
        (4, 4, "node4", 0, 2),
        (5, 5, "node4", 1, 2),
    ], job.describe()
    assert {(r["size"], r["local_size"], r["cross_size"]) for r in reports} == {(6, 2, 3)}
    assert [r["sum"] for r in reports] == [21.0] * 6  # 1 + 2 + ... + 6 on every rank
    assert [r["horovod_hostname"] for r in reports] == ["10.78.0.2"] * 2 + ["10.78.0.3"] * 2 + ["10.78.0.4"] * 2
    assert jobs.leftovers(hosts, within=10) == {}


def test_horovod_script_hostfile_launcher_off_the_hosts_np_caps_and_per_rank_logs(
    hosts: netns.Cluster, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the workers\nnode3 slots=2\n\nnode4:2   # by name, resolved like on a real cluster\n")
    logs = tmp_path / "logs"
    flags = [
        "-np",
        "3",
        "--hostfile",
        str(hostfile),
        "--ssh-config-file",
        str(hosts.ssh_config),
        "--output-filename",
        str(logs),
    ]
    # An unchanged Horovod script: `import horovod.torch as hvd` resolves to hora on every host.
    code, job = jobs.run_job(hosts, flags, [jobs.PYTHON, jobs.WORKER, "report", "--api", "horovod"], tmp_path)
    assert code == 0, job.describe()
    reports = jobs.worker_reports(job.stdout)
    assert all("/hora/_compat/horovod/" in r["module_file"] for r in reports), [r["module_file"] for r in reports]
    assert [(r["rank"], r["hostname"], r["local_rank"], r["cross_rank"]) for r in reports] == [
        (0, "node3", 0, 0),
        (1, "node3", 1, 0),
        (2, "node4", 0, 1),
    ], job.describe()
    assert [(r["local_size"], r["cross_size"], r["sum"]) for r in reports] == [
        (2, 2, 6.0),
        (2, 1, 6.0),
        (1, 2, 6.0),
    ]
    assert (logs / "rank.2" / "stdout").read_text().startswith('REPORT {"rank": 2,')
    assert jobs.leftovers(hosts, within=10) == {}


PYRUN_SCRIPT = """
import json, socket, sys
import hora

offset = 100.0  # captured by the closure below


def reduce_and_say_where():
    import torch
    import hora as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    return [hvd.rank(), socket.gethostname(), total + offset]


def fail_on_rank_2():
    import hora as hvd

    hvd.init()
    if hvd.rank() == 2:
        raise ValueError("boom on " + socket.gethostname())
    return hvd.rank()


ssh = dict(ssh_identity_file=sys.argv[1], ssh_options=sys.argv[2:])
hosts = "10.78.0.2:1,10.78.0.3:1,10.78.0.4:1"
# network_interfaces (--network-interfaces): the store binds eth0's address and every rank's Gloo uses eth0.
results = hora.run(reduce_and_say_where, num_proc=3, hosts=hosts, network_interfaces=["eth0"], **ssh)
print("RESULT " + json.dumps(results), flush=True)
try:
    hora.run(fail_on_rank_2, num_proc=3, hosts=hosts, **ssh)
except ValueError as exc:
    print("RAISED " + json.dumps([type(exc).__name__, str(exc), str(exc.__cause__)]), flush=True)
"""


def test_hora_run_function_across_hosts_returns_results_and_reraises(hosts: netns.Cluster, tmp_path: Path) -> None:
    script = tmp_path / "pyrun_hosts.py"
    script.write_text(PYRUN_SCRIPT)
    options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]
    out = hosts.host(2).run([jobs.PYTHON, str(script), str(hosts.key), *options], timeout=180, cwd=tmp_path)
    lines = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in out.stdout.splitlines()
        if line.startswith(("RESULT ", "RAISED "))
    }
    assert lines.get("RESULT") == [[0, "node2", 103.0], [1, "node3", 103.0], [2, "node4", 103.0]], out
    kind, message, remote = lines.get("RAISED", [None, None, ""])
    assert (kind, message) == ("ValueError", "boom on node4"), out
    # The rank's own traceback, naming where it ran: rank, host, the function that raised.
    assert remote.startswith("rank 2 on host 10.78.0.4 raised:\nTraceback"), remote
    assert "in fail_on_rank_2" in remote and remote.rstrip().endswith("ValueError: boom on node4"), remote
    assert jobs.leftovers(hosts, within=10) == {}
