"""Elastic ``hora run`` when a member freezes: the stall inspector's shutdown in the elastic driver.

A worker stopped by SIGSTOP cannot run Python: its peers wait for it in a negotiation round, report it after
the stall warning time (its agent says what its process is doing) and give up on it at the stall shutdown time
(HorovodInternalError: they restore the last commit and reset). The elastic driver then stops the frozen
worker as a failed one (its host is blacklisted) and publishes the next world without it, instead of waiting
``--elastic-timeout`` (600 s by default) for it to reset. Real processes: two "hosts" on loopback addresses,
the hora.elastic script of the benchmarks (benchmarks/elastic_worker.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from tests.elastic_job import ElasticJob
from tests.launcher.helpers import HORA, PYTHON, alive

WORKER = str(Path(__file__).resolve().parents[2] / "benchmarks" / "elastic_worker.py")
WAIT_S = 120.0  # a loaded 2-core machine imports torch in 10-20 s; nothing here is timed


def test_a_frozen_member_is_stopped_at_the_stall_shutdown_time_and_the_others_go_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = ElasticJob(tmp_path, [*HORA, "run", "-H", "127.0.0.1:2,127.0.0.2:1", "--min-np", "2",
                                "--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "3",
                                PYTHON, WORKER, str(out), "--sleep", "0.05"], WAIT_S)
    try:
        steps = job.wait_steps("3 workers stepping",
                               lambda steps: len({s["pid"] for s in steps if s["size"] == 3}) == 3)
        victim = next(s for s in steps if s["host"] == "127.0.0.2")
        survivors = {s["pid"] for s in steps if s["host"] == "127.0.0.1"}
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped_at = time.time()
        job.wait_steps("the other two stepping in a world of 2",
                       lambda steps: {s["pid"] for s in steps if s["size"] == 2 and s["t"] > stopped_at} == survivors)
        code, text = job.finish(stop=True)
    finally:
        job.kill()
    assert code == 0, text
    # where it froze decides which report: in a negotiation round (its peers gave up on it and reset) or in a
    # data transfer (its peers wait inside the backend and the launcher ends it)
    assert re.search(r"hora run: stall: rank 2 on host 127.0.0.2 has not (answered its peers|finished allreduce)",
                     text), text
    assert "its process is stopped (state T: SIGSTOP" in text, text
    assert re.search(r"worker 127.0.0.2:0 \(process \[2\], rank 2\) on host 127.0.0.2: (did not answer its peers "
                     r"for|did not finish allreduce)", text), text
    assert "host 127.0.0.2 blacklisted for good" in text, text
    assert "world 2: 2 workers on 127.0.0.1; left: 127.0.0.2:0" in text, text
    finals = [json.loads((out / f"final.{r}").read_text()) for r in (0, 1)]
    assert finals[0]["params"] == finals[1]["params"] and finals[0]["size"] == 2
    assert not alive(victim["pid"]) and not any(alive(p) for p in survivors)
