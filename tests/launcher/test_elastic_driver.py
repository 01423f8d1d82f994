"""``hora run``'s elastic driver end to end on this machine, with workers that speak the contract directly.

The "hosts" are loopback addresses (127.0.0.1, 127.0.0.2, ...): hora starts their agents without ssh, and each
is its own host for the driver (blacklist, discovery). The workers (elastic_protocol_worker.py) post ready,
follow the worlds the driver publishes and record every step, so these tests check the driver's decisions
(who is in which world, with which rank; who is blacklisted; when the job fails and how it says so) without
hora.elastic's worker side. The multi-host ones with ssh and the hora.elastic API are in tests/cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.elastic_job import ElasticJob
from tests.launcher.helpers import HORA, PYTHON, alive

WORKER = str(Path(__file__).with_name("elastic_protocol_worker.py"))
WAIT_S = 120.0  # a loaded 2-core machine imports torch in 10-20 s; nothing here is timed


class Elastic(ElasticJob):
    """One elastic ``hora run`` in the background, its workers (elastic_protocol_worker.py) writing to ``out``."""

    def world(self, gen: int) -> dict[str, tuple[int, int]]:
        """wid -> (rank, size) of the workers that stepped in world ``gen``."""
        return {s["wid"]: (s["rank"], s["size"]) for s in self.steps() if s["event"] == "step" and s["gen"] == gen}

    def wait_world(self, gen: int, size: int) -> dict[str, tuple[int, int]]:
        self.wait_steps(f"world {gen} of {size} stepping",
                        lambda steps: len({s["wid"] for s in steps if s["event"] == "step" and s["gen"] == gen})
                        == size)
        return self.world(gen)

    def inject(self, kind: str, wid: str) -> None:
        (self.out / f"{kind}.{wid}").touch()


@pytest.fixture
def elastic(tmp_path: Path) -> Iterator[Callable[..., Elastic]]:
    started: list[Elastic] = []

    def start(*flags: str, command: list[str] | None = None) -> Elastic:
        out = tmp_path / "out"
        started.append(Elastic(tmp_path, [*HORA, "run", *flags, *(command or [PYTHON, WORKER, str(out)])], WAIT_S))
        return started[-1]

    yield start
    for job in started:
        job.kill()


def _no_orphans(job: Elastic) -> None:
    left = [pid for pid in job.pids() if alive(pid)]
    assert not left, f"worker processes left running: {left}"


def test_discovery_grows_and_shrinks_the_world(elastic: Callable[..., Elastic], tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2\n")
    job = elastic("-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {hosts}")
    assert job.wait_world(1, 2) == {"127.0.0.1:0": (0, 2), "127.0.0.1:1": (1, 2)}
    hosts.write_text("127.0.0.1:2\n127.0.0.2:2\n")
    w2 = job.wait_world(2, 4)
    # the first host's workers keep ranks 0 and 1; the new host's come after them
    assert w2 == {"127.0.0.1:0": (0, 4), "127.0.0.1:1": (1, 4), "127.0.0.2:0": (2, 4), "127.0.0.2:1": (3, 4)}
    starts = {s["wid"]: (s["start_rank"], s["host"]) for s in job.steps()}
    assert starts["127.0.0.2:1"] == (3, "127.0.0.2")  # HOROVOD_RANK: the rank it started for; HOSTNAME as named
    hosts.write_text("127.0.0.1:2\n")
    assert job.wait_world(3, 2) == {"127.0.0.1:0": (0, 2), "127.0.0.1:1": (1, 2)}
    job.wait_steps("the removed workers leaving", lambda steps: {s["wid"] for s in steps if s["event"] == "removed"}
                 == {"127.0.0.2:0", "127.0.0.2:1"})
    code, log = job.finish(stop=True)
    assert code == 0, log
    assert "hosts added: 127.0.0.2" in log and "hosts removed: 127.0.0.2" in log
    assert "world 3: 2 workers on 127.0.0.1; left: 127.0.0.2:0, 127.0.0.2:1" in log
    _no_orphans(job)


def test_a_failed_worker_blacklists_its_host_for_new_workers_only_and_it_comes_back_after_the_cooldown(
        elastic: Callable[..., Elastic]) -> None:
    """The blacklist decides where new workers start, not who is stopped (issue 27 item 2; Horovod 0.28.1 stops
    every worker of a blacklisted host): the failed worker's host-mate trains on, and once the cooldown ends its
    empty slot gets a new process."""
    job = elastic("-H", "127.0.0.1:2,127.0.0.2:2", "--min-np", "2", "--blacklist-cooldown-range", "2", "2",
                  "--reset-limit", "3")
    assert len(job.wait_world(1, 4)) == 4
    job.inject("raise", "127.0.0.2:1")  # an exception: its host is blacklisted, its healthy host-mate stays
    w2 = job.wait_world(2, 3)
    assert w2 == {"127.0.0.1:0": (0, 3), "127.0.0.1:1": (1, 3), "127.0.0.2:0": (2, 3)}
    # the cooldown ends: the failed slot gets a new process, numbered after the survivors
    w3 = job.wait_world(3, 4)
    assert w3["127.0.0.2:1"] == (3, 4)
    job.inject("kill", "127.0.0.1:0")  # SIGKILL of rank 0: the next survivor in rank order becomes rank 0
    w4 = job.wait_world(4, 3)
    assert w4 == {"127.0.0.1:1": (0, 3), "127.0.0.2:0": (1, 3), "127.0.0.2:1": (2, 3)}
    code, log = job.finish(stop=True)
    assert code == 0, log  # 3 resets: within --reset-limit 3
    assert "RuntimeError: 127.0.0.2:1: injected failure" in log  # the failed worker's traceback is shown
    assert "host 127.0.0.2 blacklisted for 2s (no new worker starts there)" in log
    assert "worker 127.0.0.1:0 (process [0], rank 0) on host 127.0.0.1 failed: signal SIGKILL (9)" in log
    _no_orphans(job)


def test_a_recovery_is_one_line_saying_what_happened_and_that_the_job_goes_on(
        elastic: Callable[..., Elastic]) -> None:
    """Issue 27 item 4: the survivors printed 'hora: error: rank 0: rank 3 on host ... is gone' and a warning
    each while the job recovered and succeeded. The launcher's line names the cause and says the job goes on;
    the survivors' view of it (a consequence) stays below warning level."""
    job = elastic("-H", "127.0.0.1:2,127.0.0.2:2", "--min-np", "2", "--blacklist-cooldown-range", "1", "1")
    job.wait_world(1, 4)
    job.inject("kill", "127.0.0.2:1")
    job.wait_world(2, 3)
    code, log = job.finish(stop=True)
    assert code == 0, log
    about = [line for line in log.splitlines() if "127.0.0.2:1" in line or "is gone" in line or "error" in line
             or "warning" in line or "restoring the last commit" in line]
    assert about == ["hora run: elastic: worker 127.0.0.2:1 (process [3], rank 3) on host 127.0.0.2 failed: signal "
                     "SIGKILL (9); the others go back to the last commit and go on; host 127.0.0.2 blacklisted for "
                     "1s (no new worker starts there)",
                     "hora run: elastic: world 2: 3 workers on 127.0.0.1, 127.0.0.2; left: 127.0.0.2:1"], log
    _no_orphans(job)


def test_more_resets_than_the_limit_fail_the_job(elastic: Callable[..., Elastic]) -> None:
    job = elastic("-H", "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", "--min-np", "1", "--reset-limit", "1")
    job.wait_world(1, 3)
    job.inject("kill", "127.0.0.3:0")
    job.wait_world(2, 2)
    job.inject("raise", "127.0.0.2:0")
    code, log = job.finish()
    assert code == 75, log  # the limit's exit status, not the raising worker's
    assert ("hora run: job failed: --reset-limit 1 reached: the job has reset 1 time and worker 127.0.0.2:0 failed, "
            "which needs another reset; it stops here (exit code 75)") in log, log
    assert "RuntimeError: 127.0.0.2:0: injected failure" in log  # the root cause's report
    _no_orphans(job)


def test_the_reset_limit_counts_resets_and_ends_with_its_own_exit_status(elastic: Callable[..., Elastic],
                                                                         tmp_path: Path) -> None:
    """Issue 25 item 6: after one reset (a SIGKILLed worker the job survived), a host added with --reset-limit 1
    said "the job reset 2 times" and exited 137, the old SIGKILL's status."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    job = elastic("-np", "2", "--min-np", "1", "--reset-limit", "1", "--host-discovery-script", f"cat {hosts}")
    job.wait_world(1, 2)
    job.inject("kill", "127.0.0.2:0")
    job.wait_world(2, 1)
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n127.0.0.3:1\n")
    code, log = job.finish()
    assert code == 75, log
    assert log.rstrip().endswith("hora run: job failed: --reset-limit 1 reached: the job has reset 1 time and the "
                                 "hosts changed, which needs another reset; it stops here (exit code 75)"), log
    assert "the last failure" not in log  # the SIGKILL the job survived is not this ending's cause
    _no_orphans(job)


def test_fewer_than_min_np_for_the_elastic_timeout_fails_the_job(elastic: Callable[..., Elastic]) -> None:
    job = elastic("-H", "127.0.0.1:1,127.0.0.2:1", "--min-np", "2", "--elastic-timeout", "3")
    job.wait_world(1, 2)
    job.inject("kill", "127.0.0.2:0")
    code, log = job.finish()
    assert code != 0, log
    assert "1 slot available, fewer than the 2 of --min-np; waiting up to --elastic-timeout 3s" in log
    assert "job failed: fewer than 2 slots (--min-np) for --elastic-timeout 3s: 1 available" in log
    assert "blacklisted: 127.0.0.2" in log
    _no_orphans(job)


def test_every_worker_failing_blacklists_every_host_and_ends_the_job(elastic: Callable[..., Elastic]) -> None:
    job = elastic("-H", "127.0.0.1:1,127.0.0.2:2", "--min-np", "1",
                  command=[PYTHON, "-c", "import sys; print('cannot train', file=sys.stderr); sys.exit(3)"])
    code, log = job.finish()
    assert code == 3, log
    assert "job failed: every host is blacklisted (127.0.0.1, 127.0.0.2)" in log
    assert "cannot train" in log  # the last failure's stderr, in its report
    assert log.count("job failed") == 1


def test_a_transient_empty_discovery_answer_stops_no_worker(elastic: Callable[..., Elastic], tmp_path: Path) -> None:
    """Issue 25 item 6: a discovery script that prints nothing for a few seconds (a cloud API's hiccup) ended the
    job at once ("no worker of world 1 is left"), right after saying it would wait --elastic-timeout. The workers
    of the only hosts hold the training state: they go on until discovery lists their hosts again."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    job = elastic("-np", "2", "--min-np", "2", "--host-discovery-script", f"cat {hosts}")
    job.wait_world(1, 2)
    hosts.write_text("")
    job.wait_output("discovery lists none of the hosts")
    before = len(job.steps())
    job.wait_steps("the workers training on", lambda steps: len(steps) > before + 20)
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    job.wait_output("discovery lists 127.0.0.1, 127.0.0.2 again")
    code, log = job.finish(stop=True)
    assert code == 0, log
    assert {s["gen"] for s in job.steps() if s["event"] == "step"} == {1}  # no reset, no worker replaced
    assert len(job.pids()) == 2
    assert "hosts removed" not in log and "no worker of world" not in log and "waiting up to" not in log, log
    assert ("hora run: elastic: discovery lists none of the hosts of world 1's workers (127.0.0.1, 127.0.0.2), which "
            "hold the training state: they go on until discovery lists their hosts again or other hosts can take the "
            "state over (up to --elastic-timeout 600s)") in log, log
    _no_orphans(job)


def test_a_host_missing_from_one_discovery_answer_is_not_removed(elastic: Callable[..., Elastic],
                                                                  tmp_path: Path) -> None:
    hosts, blip, answers = tmp_path / "hosts", tmp_path / "blip", tmp_path / "answers"
    hosts.write_text("127.0.0.1:1\n127.0.0.2:1\n")
    script = tmp_path / "discover.sh"
    # while the file blip exists, one answer leaves 127.0.0.2 out (a flaky API); every answer is counted
    script.write_text(f"#!/bin/sh\necho x >> {answers}\n"
                      f"if [ -e {blip} ]; then rm {blip}; echo 127.0.0.1:1; else cat {hosts}; fi\n")
    script.chmod(0o755)
    job = elastic("-np", "2", "--min-np", "1", "--host-discovery-script", str(script))
    job.wait_world(1, 2)
    blip.touch()
    job.wait_steps("the short answer", lambda _: not blip.exists())
    seen = len(answers.read_text().splitlines())
    job.wait_steps("two more answers", lambda _: len(answers.read_text().splitlines()) >= seen + 2)
    hosts.write_text("127.0.0.1:1\n")  # now it is gone for good: removed after two answers
    assert job.wait_world(2, 1) == {"127.0.0.1:0": (0, 1)}
    code, log = job.finish(stop=True)
    assert code == 0, log
    assert log.count("hosts removed: 127.0.0.2") == 1 and "hosts added" not in log, log
    _no_orphans(job)
