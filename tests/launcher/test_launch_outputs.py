"""A job's output files (issue 25, items 1 and 2): a second job never destroys a running job's logs or
timeline, and a full log disk costs the logs, not the job."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.launcher.helpers import PYTHON, hora_run, write_script
from tests.polling import wait_until

# Each rank says it started, waits for DIR/go, then prints its lines through one timed allreduce (a timeline
# event) and exits 0.
CHATTY = """
import os, sys, time
import torch
import hora as hvd

hvd.init()
folder, tag = sys.argv[1], sys.argv[2]
open(os.path.join(folder, f"started.{tag}.{hvd.rank()}"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.05)
hvd.allreduce(torch.ones(4), name="step")
for i in range(3):
    print(f"{tag} line {i}", flush=True)
"""


def test_a_second_job_with_the_same_output_paths_is_refused_and_the_first_keeps_its_files(
        tmp_path: Path, background) -> None:  # type: ignore[no-untyped-def]
    script = write_script(tmp_path, "chatty.py", CHATTY)
    flags = ["-np", "2", "--output-filename", "logs", "--timeline-filename", "t.json"]
    first = background([*flags, PYTHON, script, str(tmp_path), "first"])
    assert wait_until(lambda: all((tmp_path / f"started.first.{r}").exists() for r in range(2)), 60), \
        first.err.read_text()

    second = hora_run([*flags, PYTHON, script, str(tmp_path), "second"], tmp_path)
    assert second.returncode == 2, second.stderr
    assert re.fullmatch(r"hora run: error: --output-filename logs: job [0-9a-f]{12} \(hora run, pid \d+ on host \S+, "
                        r"started \d\d:\d\d:\d\d\) is writing there; two jobs would overwrite each other's files\. "
                        r"Give this job another path, or wait for that job to end\n", second.stderr), second.stderr
    alone = hora_run(["-np", "2", "--output-filename", "other", "--timeline-filename", "t.json",
                      PYTHON, script, str(tmp_path), "second"], tmp_path)
    assert alone.returncode == 2, alone.stderr
    assert alone.stderr.startswith(f"hora run: error: --timeline-filename {tmp_path / 't.json'}: job "), alone.stderr
    assert not list(tmp_path.glob("started.second.*"))  # refused before anything started

    (tmp_path / "go").write_text("")
    code, out, err = first.finish(60)
    assert code == 0, err
    for rank in range(2):
        assert (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text() == \
            "".join(f"first line {i}\n" for i in range(3))
    events = json.loads((tmp_path / "t.json").read_text())
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert f"hora run: timeline written to {tmp_path / 't.json'}" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("t.", ".t."))) == ["t.json"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank.0", "rank.1"]  # lock file gone


def test_a_full_log_disk_warns_once_and_the_job_goes_on(tmp_path: Path, small_disk) -> None:  # type: ignore[no-untyped-def]
    disk = small_disk(64)
    script = write_script(tmp_path, "loud.py", """
        import os
        rank = os.environ["HORA_RANK"]
        for i in range(1500):
            print(f"rank {rank} line {i:04d} " + "x" * 60)
        """)
    result = hora_run(["-np", "2", "--output-filename", str(disk / "logs"), PYTHON, script], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3000 and f"[1]<stdout>:rank 1 line 1499 {'x' * 60}" in lines  # the console got them all
    warnings = [ln for ln in result.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1, result.stderr
    assert re.fullmatch(rf"hora run: warning: cannot write the log file {disk}/logs/rank\.[01]/stdout \(No space "
                        rf"left on device\); --output-filename {disk}/logs gets no more lines from this job, the "
                        r"console output goes on", warnings[0]), result.stderr
    assert "Traceback" not in result.stderr


def _fill(disk: Path) -> None:
    """Take every free block of ``disk``."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_disk_full_before_the_job_starts_warns_naming_each_file_and_the_job_runs(
        tmp_path: Path, small_disk) -> None:  # type: ignore[no-untyped-def]
    """Issue 33.1: every file hora writes at start on a full disk (the lock records, the logs, the ranks'
    timeline parts, the merged timeline) is one warning naming it; the job runs and says what it printed."""
    disk = small_disk(64)
    _fill(disk)
    script = write_script(tmp_path, "hello.py", """
        import hora as hvd
        hvd.init()
        print("hello from", hvd.rank())
        hvd.shutdown()
        """)
    result = hora_run(["-np", "2", "--output-filename", str(disk / "logs"), "--timeline-filename",
                       str(disk / "t.json"), PYTHON, script], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0]<stdout>:hello from 0", "[1]<stdout>:hello from 1"]
    assert "Traceback" not in result.stderr, result.stderr
    full = r"\(No space left on device\)"
    for lock in (rf"{disk}/logs/\.hora-job\.lock", rf"{disk}/\.t\.json\.hora-job\.lock"):
        assert re.search(rf"^hora run: warning: cannot write {lock} {full}: its filesystem is full; the job runs",
                         result.stderr, re.MULTILINE), result.stderr
    assert re.search(rf"^hora run: warning: cannot write the log file {disk}/logs/rank\.[01]/std(out|err) {full}; ",
                     result.stderr, re.MULTILINE), result.stderr
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}\]<stderr>:hora: warning: timeline {disk}/t\.json: rank {rank} cannot write "
                         rf"{disk}/t\.[0-9a-f]{{12}}\.rank{rank}\.json {full}; this rank records no timeline, "
                         "training goes on$", result.stderr, re.MULTILINE), result.stderr
    merged = (rf"^hora run: no rank wrote a timeline file \(did the ranks call hvd\.init\(\)\? a rank that could not "
              rf"write its file said why\): {disk}/t\.json not written$")
    assert re.search(merged, result.stderr, re.MULTILINE), result.stderr
    assert "WARNING" not in result.stderr, result.stderr  # no merge of files that are not there


def test_hora_secret_on_a_full_disk_is_one_line_and_leaves_no_file(small_disk) -> None:  # type: ignore[no-untyped-def]
    from hora.protocol import jobsecret

    disk = small_disk(64)
    _fill(disk)
    assert jobsecret.main([str(disk / "job.secret")]) == 2
    assert not (disk / "job.secret").exists()
