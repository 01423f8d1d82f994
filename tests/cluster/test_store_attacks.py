"""A stranger on the cluster network overwrites the store keys of a 2-host job, one kind of key at a time
(issue 23): the launcher on node2, ranks on node2 and node3, the attacker (attacker.py) on node4 with nothing but
TCP to the store. For every attack: no attacker code runs (the canary its pickles would create never appears),
no rank follows a forged address to the attacker, and the job either gives the exact results or fails with one
line naming the key it could not trust, at once, not at a timeout. The store listens on the job's address only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cluster import jobs, netns
from tests.cluster import test_elastic as elastic
from tests.polling import wait_until

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
ATTACKER = str(HERE / "attacker.py")
WORKER = str(HERE / "attacked_worker.py")
TWO_HOSTS = ["-np", "2", "-H", "10.78.0.2:1,10.78.0.3:1"]
EXACT = [[3.0 * i + 2 * step for i in range(4)] for step in range(5)]  # ranks 0, 1: arange(4) * (rank + 1) + step
REFUSED = (r"the value of store key '{key}' on the rendezvous store at 10\.78\.0\.2:\d+ failed authentication and "
           r"was not used: [^\n]*\(a stranger on the network, or a process of another job; see docs/security\.md\)")


def _store_address(host: netns.Host, pid: int, timeout: float = 60) -> tuple[str, int]:
    """Where process ``pid`` on ``host`` listens for other hosts (the launcher: its store), as the attacker would
    find it."""
    listing = [""]

    def listened() -> re.Match[str] | None:
        listing[0] = host.run(["ss", "-ltnpH"]).stdout
        # not torch's own server of the store, on the loopback interface behind the guard: no other host sees it
        return re.search(rf"\s(?!127\.0\.0\.1:)(\S+):(\d+)\s+\S+\s+users:\(\(\"[^\"]*\",pid={pid},", listing[0])

    found = wait_until(listened, timeout=timeout, step=0.02)
    if found is None:
        raise AssertionError(f"process {pid} never listened on {host.hostname}:\n{listing[0]}")
    return found.group(1).strip("[]"), int(found.group(2))


@contextmanager
def _attacker(cluster: netns.Cluster, where: Path, targets: Sequence[str]) -> Iterator[Path]:
    """The attacker on node4, told the store's address through ``where/store`` by the caller."""
    where.mkdir()
    with open(where / "attacker.out", "w") as out:
        proc = cluster.host(4).popen([jobs.PYTHON, ATTACKER, str(where), *targets], stdout=out,
                                     stderr=subprocess.STDOUT)
    try:
        yield where
    finally:
        (where / "stop").touch()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _attacked(where: Path) -> set[str]:
    lines = (where / "attacks.jsonl").read_text().splitlines() if (where / "attacks.jsonl").exists() else []
    return {json.loads(line)["key"] for line in lines}


def _exact_or_refused(code: int | None, job: jobs.Job, key: str) -> str:
    """The two outcomes an attack on a key that is read once may have: the forged value was read and refused
    (the job failed with one line naming the key), or the reader got the job's own value first (it is
    overwritten a millisecond later) and the results are exact. Which one it was."""
    if code == 0:
        assert [r["sums"] for r in jobs.worker_reports(job.stdout)] == [EXACT, EXACT], job.describe()
        return "exact"
    assert code not in (None, 0), job.describe()
    assert re.search(REFUSED.format(key=key) + "$", job.stderr, re.MULTILINE), job.describe()
    return "refused"


def _no_attacker_code_ran_and_no_rank_followed_it(where: Path) -> None:
    assert not list(where.glob("canary.*")), [p.read_text() for p in where.glob("canary.*")]
    assert not (where / "connections").exists(), (where / "connections").read_text()


def _run(cluster: netns.Cluster, tmp: Path, targets: Sequence[str], flags: Sequence[str] = (),
         worker_args: Sequence[str] = ()) -> tuple[int | None, jobs.Job, Path]:
    with _attacker(cluster, tmp / "attack", targets) as where:
        job = jobs.start_job(cluster, [*TWO_HOSTS, *jobs.hora_ssh_flags(cluster), *flags],
                             [jobs.PYTHON, WORKER, str(where), *worker_args], tmp)
        listening, port = _store_address(cluster.host(2), job.proc.pid)
        (where / "store").write_text(f"10.78.0.2:{port}")
        code = job.wait(180)
    assert listening == "10.78.0.2"  # the job's address, not every interface of the launcher's host ("*")
    return code, job, where


def test_forged_mesh_addresses_are_refused_naming_the_key(hosts: netns.Cluster, tmp_path: Path) -> None:
    code, job, where = _run(hosts, tmp_path, ["mesh"])
    assert {k.split("/")[-2] for k in _attacked(where)} == {"mesh"}
    # rank 1 reads rank 0's address to connect to it: a forged one is refused, naming the key, in one line of
    # its own (hora's frames are not shown), at once: no timeout, no misleading "reach each other"
    if _exact_or_refused(code, job, r"hora/[0-9a-f]{12}/g1/mesh/0") == "refused":
        refused = REFUSED.format(key=r"hora/[0-9a-f]{12}/g1/mesh/0")
        assert re.search(rf"^\[1\](<stderr>)?: ?hora\.StoreAuthError: {refused}$", job.stderr, re.MULTILINE)
        assert "/hora/" not in "".join(ln for ln in job.stderr.splitlines() if ln.lstrip().startswith("[1]:   File"))
    assert "must reach each other" not in job.stderr and "did not connect" not in job.stderr
    _no_attacker_code_ran_and_no_rank_followed_it(where)
    assert jobs.leftovers(hosts, within=10) == {}


def test_forged_board_posts_death_watch_bells_and_counters_leave_the_results_exact(
        hosts: netns.Cluster, tmp_path: Path) -> None:
    flags = ["-x", "HORA_CONTROL_PLANE=gloo", "--stall-check-warning-time-seconds", "1"]  # watch and bell keys
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "attacker.ready").touch()
    (clean / "job.seen").touch()  # no attacker in the clean run
    code, job = jobs.run_job(hosts, [*TWO_HOSTS, *jobs.hora_ssh_flags(hosts), *flags],
                             [jobs.PYTHON, WORKER, str(clean), "--hold", "2.5"], clean, timeout=180)
    assert code == 0, job.describe()
    baseline = max(r["init_s"] for r in jobs.worker_reports(job.stdout))
    attacked_dir = tmp_path / "attacked"
    attacked_dir.mkdir()
    code, job, where = _run(hosts, attacked_dir, ["board", "watch", "lost", "bell"], flags, ["--hold", "2.5"])
    assert code == 0, job.describe()
    reports = jobs.worker_reports(job.stdout)
    assert [r["sums"] for r in reports] == [EXACT, EXACT], job.describe()
    keys = _attacked(where)
    assert any("/board/waiting/" in k for k in keys) and any("/g1/watch/" in k for k in keys), keys
    # what was read was refused and said so (inflight/1 only the attacker writes: the launcher read it after the
    # counter the attacker bumps; a forged death watch address, when read before rank 0's own, the same way), and
    # nothing forged reached the launcher's stall lines or the ranks
    assert re.search(REFUSED.format(key=r"hora/[0-9a-f]{12}/board/inflight/1") + "; ignored$", job.stderr,
                     re.MULTILINE), job.describe()
    for line in job.stderr.splitlines():
        if "death watch" in line:
            assert re.search(r"death watch of rank \d not set up \(" + REFUSED.format(key=r"[^']*/g1/watch/\d"),
                             line), line
    assert "pwned" not in job.stdout + job.stderr, job.describe()
    assert max(r["init_s"] for r in reports) <= 2 * baseline + 1.0, (baseline, reports)
    _no_attacker_code_ran_and_no_rank_followed_it(where)
    assert jobs.leftovers(hosts, within=10) == {}


PYRUN = """
import json, pathlib, sys, time
import hora

where = pathlib.Path(sys.argv[1])


def work():
    import torch
    import hora as hvd

    while not (where / "attacker.ready").exists():
        time.sleep(0.01)
    hvd.init()
    out = [hvd.rank(), hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()]
    hvd.shutdown()
    return out


try:
    result = hora.run(work, np=2, hosts="10.78.0.2:1,10.78.0.3:1", ssh_identity_file=sys.argv[2],
                      ssh_options=sys.argv[3:])
    print("RESULT " + json.dumps(result), flush=True)
except Exception as exc:
    print("RAISED " + json.dumps([type(exc).__name__, str(exc)]), flush=True)
"""


def _pyrun(cluster: netns.Cluster, tmp: Path, targets: Sequence[str]) -> tuple[str, list[object], Path]:
    script = tmp / "pyrun_attacked.py"
    script.write_text(PYRUN)
    options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]
    with _attacker(cluster, tmp / "attack", targets) as where, open(tmp / "script.out", "w") as out:
        proc = cluster.host(2).popen([jobs.PYTHON, str(script), str(where), str(cluster.key), *options], cwd=tmp,
                                     stdout=out, stderr=subprocess.STDOUT)
        listening, port = _store_address(cluster.host(2), proc.pid)
        (where / "store").write_text(f"10.78.0.2:{port}")
        try:
            proc.wait(timeout=180)
        finally:
            proc.kill()
    text = (tmp / "script.out").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith(("RESULT ", "RAISED "))), "NONE null")
    kind, _, value = line.partition(" ")
    return kind, json.loads(value), where


@pytest.mark.parametrize("target,key", [("fn", "hora.run/fn"), ("result", "hora.run/result/0")])
def test_hora_run_never_unpickles_a_forged_function_or_result(hosts: netns.Cluster, tmp_path: Path, target: str,
                                                             key: str) -> None:
    kind, value, where = _pyrun(hosts, tmp_path, [target])
    _no_attacker_code_ran_and_no_rank_followed_it(where)  # in the ranks (fn) and in the launcher (results)
    assert kind == "RAISED", (kind, value, (tmp_path / "script.out").read_text()[-3000:])
    assert value[0] == "StoreAuthError", value  # type: ignore[index]
    assert re.fullmatch(REFUSED.format(key=re.escape(key)), value[1]), value  # type: ignore[index]
    assert key in _attacked(where)
    assert jobs.leftovers(hosts, within=10) == {}


@pytest.mark.parametrize("target,key", [("elastic-world", r"hora/[0-9a-f]{12}/elastic/(gen|world/1)"),
                                        ("elastic-ready", r"hora/[0-9a-f]{12}/elastic/ready/10\.78\.0\.[23]:0")])
def test_forged_elastic_worlds_and_ready_posts_fail_the_job_naming_the_key(hosts: netns.Cluster, tmp_path: Path,
                                                                          target: str, key: str) -> None:
    flags = ["--min-np", "2", "--max-np", "2", "--elastic-timeout", "20"]
    code, job, where = _run(hosts, tmp_path, [target], flags)
    # the world keys are forged before the launcher writes them: refused; a ready post, once read, is not read
    # again, so both workers' first posts may have been read before the attacker's copy (then: exact)
    outcome = _exact_or_refused(code, job, key)
    assert outcome == "refused" or target == "elastic-ready", job.describe()
    _no_attacker_code_ran_and_no_rank_followed_it(where)
    assert jobs.leftovers(hosts, within=10) == {}


def _rss_mb(host: netns.Host, pid: int) -> float:
    status = host.run(["cat", f"/proc/{pid}/status"]).stdout
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024  # type: ignore[union-attr]


def test_a_stranger_flooding_the_store_is_cut_off_and_the_launcher_stays_bounded(
        hosts: netns.Cluster, tmp_path: Path) -> None:
    """Issue 33.4: 300 values of 1 MiB from a stranger grew the launcher from 232 MB to 542 MB. The store's
    guard takes at most HORA_STORE_MAX_HOST_MB (64) from the stranger's host, closes its connection, and the job
    (whose ranks are on other hosts) gives exact results."""
    with _attacker(hosts, tmp_path / "attack", ["flood"]) as where:
        job = jobs.start_job(hosts, [*TWO_HOSTS, *jobs.hora_ssh_flags(hosts)],
                             [jobs.PYTHON, WORKER, str(where), "--hold", "1"], tmp_path)
        _, port = _store_address(hosts.host(2), job.proc.pid)
        before = _rss_mb(hosts.host(2), job.proc.pid)
        (where / "store").write_text(f"10.78.0.2:{port}")
        wait_until((where / "flood.json").exists, timeout=120, step=0.05)  # read below: missing, the test fails
        after = _rss_mb(hosts.host(2), job.proc.pid)  # the ranks wait for attacker.ready: the job still runs
        code = job.wait(180)
    flood = json.loads((where / "flood.json").read_text())
    print(f"launcher RSS {before:.0f} MB before the flood, {after:.0f} MB after; flood {flood}")  # for the record
    assert code == 0, job.describe()
    assert [r["sums"] for r in jobs.worker_reports(job.stdout)] == [EXACT, EXACT], job.describe()
    assert flood["sent"] < 300 and flood["error"], flood  # cut off before its 300 MiB were taken
    assert re.search(r"the rendezvous store closed the connection of 10\.78\.0\.4:\d+: its host would hold "
                     r"\d+ bytes in the store with 'hora/flood/\d+' \(at most 67108864 per host: "
                     r"HORA_STORE_MAX_HOST_MB\)", job.stderr), job.describe()
    assert after - before < 64 + 48, (before, after)  # its host's 64 MiB and the relay's buffers, not 300 MiB
    _no_attacker_code_ran_and_no_rank_followed_it(where)
    assert jobs.leftovers(hosts, within=10) == {}


def test_an_older_elastic_gen_put_back_by_a_stranger_delays_no_worker(hosts: netns.Cluster, tmp_path: Path) -> None:
    """Issue 33.5: ``elastic/gen`` is rewritten in place, so world 1's value keeps a valid MAC; the attacker holds it
    there once the driver writes a newer one. A worker lost, the world shrinks (world 2), then a host is added:
    its new worker still joins the world made for it at once. Before the fix it read "1", found world 2 (which
    does not hold it) already there and looked again, until --elastic-timeout."""
    listed = tmp_path / "hosts.txt"
    listed.write_text("10.78.0.3:2\n10.78.0.4:1\n")
    with _attacker(hosts, tmp_path / "attack", ["gen-replay"]) as where:
        out = tmp_path / "out"
        out.mkdir()
        flags = ["-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {listed}",
                 "--elastic-timeout", "30"]
        job = jobs.start_job(hosts, [*flags, *jobs.hora_ssh_flags(hosts)],
                             [jobs.PYTHON, elastic.WORKER, str(out), "--sleep", "0.05"], tmp_path)
        _, port = _store_address(hosts.host(2), job.proc.pid)
        (where / "store").write_text(f"10.78.0.2:{port}")
        first = elastic._wait_world(job, out, 3)
        assert wait_until((where / "gen.captured").exists, timeout=60, step=0.05), "the attacker never read elastic/gen"
        lost = time.time()
        os.kill(first["10.78.0.4:0"][1], signal.SIGKILL)  # the hosts share this machine's process ids
        elastic._wait_world(job, out, 2, since=lost)
        added = time.time()
        listed.write_text("10.78.0.3:2\n10.78.0.4:1\n10.78.0.2:1\n")  # node4 stays blacklisted
        grown = elastic._wait_world(job, out, 3, since=added)
        assert {w: r for w, (r, _) in grown.items()} == {"10.78.0.3:0": 0, "10.78.0.3:1": 1, "10.78.0.2:0": 2}
    elastic._finish(job, out, hosts, 3)  # the attacker stopped: nothing may be left on any host
    replays = [json.loads(line) for line in (where / "attacks.jsonl").read_text().splitlines()]
    assert any(r.get("replayed") for r in replays), replays  # world 2's gen was put back to world 1's
    _no_attacker_code_ran_and_no_rank_followed_it(where)


def test_the_secret_travels_over_ssh_on_stdin_only(hosts: netns.Cluster, tmp_path: Path) -> None:
    """No ssh command line, agent or sshd session holds the job's secret: only the ranks' own environments."""
    worker = str(jobs.ROOT / "tests" / "launcher" / "secret_worker.py")
    code, job = jobs.run_job(hosts, [*TWO_HOSTS, *jobs.hora_ssh_flags(hosts)],
                             [jobs.PYTHON, worker, str(tmp_path), "raise"], tmp_path, timeout=180)
    assert code == 1 and "rank 1 gives up" in job.stderr, job.describe()
    scans = [json.loads((tmp_path / f"scan.{r}").read_text()) for r in (0, 1)]
    secret = scans[0]["secret"]
    assert scans[1]["secret"] == secret and len(secret) == 64
    for s in scans:  # each rank looked at every process of the machine (the hosts share one pid namespace)
        assert s["cmdline"] == [], s["cmdline"]
        assert {p["pid"] for p in s["environ"]} == {scans[0]["pid"], scans[1]["pid"]}, s["environ"]
    assert secret not in job.stdout + job.stderr
    assert jobs.leftovers(hosts, within=10) == {}
