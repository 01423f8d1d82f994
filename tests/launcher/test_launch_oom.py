"""A rank killed by the kernel's out-of-memory killer is named as such, with its cgroup's limit (issue 25,
item 5): the job runs in a memory cgroup, as in a container or a pod with a memory limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hora.launcher.remote import oom
from tests.launcher.helpers import HORA, PYTHON, write_script
from tests.polling import wait_until

HOG = """
import os, sys, time
if os.environ.get("HORA_RANK", "1") == "1":
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    hoard = []
    while True:  # more and more memory, every page touched
        hoard.append(bytearray(32 << 20))
while True:
    time.sleep(0.1)
"""


def test_a_rank_killed_by_the_oom_killer_is_named_with_the_cgroup_limit(
        tmp_path: Path, memory_limit) -> None:  # type: ignore[no-untyped-def]
    enter = memory_limit(1024)  # the launcher (with torch) fits; rank 1 does not
    script = write_script(tmp_path, "hog.py", HOG)
    go = tmp_path / "go"
    go.write_text("")
    result = subprocess.run([*HORA, "run", "-np", "2", PYTHON, script, str(go)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=180, preexec_fn=enter)
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert ("hora run: rank 1 on host localhost failed first: killed by the kernel's out-of-memory killer (cgroup "
            "limit 1024 MB), signal SIGKILL (9)\n") in result.stderr, result.stderr
    assert "hora run: hint: the rank needed more memory than its limit allows" in result.stderr
    assert result.stderr.rstrip().endswith("hora run: job failed: rank 1 on host localhost: killed by the kernel's "
                                           "out-of-memory killer (cgroup limit 1024 MB), signal SIGKILL (9)")


def _hog(script: str, go: Path, enter) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    """A process in the cgroup that starts eating memory once ``go`` exists."""
    return subprocess.Popen([sys.executable, script, str(go)], preexec_fn=enter)


@pytest.mark.parametrize("kernel_log", [True, False], ids=["kernel log", "cgroup counter only"])
def test_the_agents_watch_tells_an_oom_kill_from_another_sigkill(
        tmp_path: Path, memory_limit, monkeypatch: pytest.MonkeyPatch, kernel_log: bool) -> None:  # type: ignore[no-untyped-def]
    if not kernel_log:  # as for a user who cannot read the kernel log (dmesg_restrict)
        monkeypatch.setattr(oom, "_kernel_log", lambda pid: None)
    enter = memory_limit(96)
    watch = oom.OomWatch()
    script, go = write_script(tmp_path, "hog.py", HOG), tmp_path / "go"
    bystander = _hog(script, tmp_path / "never", enter)  # waits for a file nobody writes: we kill it
    hog = _hog(script, go, enter)
    try:
        for proc in (bystander, hog):
            assert wait_until(lambda p=proc: oom.memory_cgroup(p.pid) is not None, 10)
            watch.track(proc.pid)
        go.write_text("")
        assert hog.wait(timeout=60) == -signal.SIGKILL
        bystander.kill()
        assert bystander.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in (bystander, hog):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert watch.explain(hog.pid) == "killed by the kernel's out-of-memory killer (cgroup limit 96 MB)"
    assert watch.explain(bystander.pid) is None  # a SIGKILL from elsewhere in the same cgroup
    assert os.path.basename(str(watch.cgroups[hog.pid].path)).startswith("hora-test-")  # type: ignore[union-attr]
