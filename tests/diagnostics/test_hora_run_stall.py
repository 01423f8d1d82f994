"""Through ``hora run``: a stalled job is reported once, stopped with the report as root cause, and its
timeline is merged into one valid file with every rank's row."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.stalled_job import write_stalled_script

HORA = str(Path(sys.executable).parent / "hora")


def test_stalled_job_is_reported_once_stopped_and_its_timeline_merged(tmp_path):
    script = write_stalled_script(tmp_path, stuck_rank=1)
    trace = tmp_path / "trace.json"
    done = subprocess.run(
        [HORA, "run", "-np", "2", "--stall-check-warning-time-seconds", "1",
         "--stall-check-shutdown-time-seconds", "3", "--timeline-filename", str(trace),
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    # one report in the whole job, from the rank that arrived, naming the stuck rank and its function
    logged = [line for line in out.splitlines() if re.match(r"\[\d+\]<stderr>:hora stall:", line)]
    assert len(logged) == 1, out
    assert logged[0].startswith("[0]<stderr>:hora stall: allreduce 'loss'")
    assert re.search(r"missing: rank 1 on \S+: running train\.py:\d+ stuck_in_data_loader <- train\.py:\d+ "
                     r"<module>", out)
    # the headline names the stuck rank (issue 17 item 6), not rank 0, whose CollectiveTimeoutError carries the report
    assert re.search(r"hora run: rank 1 on host localhost failed first: did not call allreduce 'loss' within "
                     r"--stall-check-shutdown-time-seconds 3 s \(running train\.py:\d+ stuck_in_data_loader .*\) "
                     r"\(rank 0 on host localhost waited for it and raised CollectiveTimeoutError\)", out), out
    assert re.search(r"CollectiveTimeoutError: hora stall: allreduce 'loss'", out)
    assert (f"hora run: timeline written to {trace} (open it in https://ui.perfetto.dev or chrome://tracing)"
            in done.stderr.splitlines())
    events = json.loads(trace.read_text())
    ranks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert ranks == {0: "rank 0", 1: "rank 1"}
    warmup = {e["pid"] for e in events if e["ph"] == "X" and e["args"]["name"] == "warmup"}
    assert warmup == {0, 1}
