"""The training script of the store attack tests: rank 0 tells the attacker the job's id (DIR/job, as an attacker
that watched the store long enough would learn it), every rank waits until the attacker forged the job's keys
once (DIR/job.seen), then init() (timed),
a few allreduces whose exact sums it reports, one of them after rank 1 held its peers up (the board speaks).

    python attacked_worker.py DIR [--hold S]

Prints one ``REPORT {json}`` line: rank, the sums, how long ``hvd.init()`` took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import hora as hvd


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--hold", type=float, default=0.0, help="rank 1 sleeps this long before the 3rd allreduce")
    args = parser.parse_args()
    folder = Path(args.dir)
    if os.environ.get("HORA_RANK") == "0":  # the attacker learns the job's id before any rank writes a key
        (folder / "job.tmp").write_text(os.environ["HORA_JOB_ID"])
        (folder / "job.tmp").rename(folder / "job")
    ready = folder / "job.seen"  # the attacker has forged the job's keys once
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    began = time.monotonic()
    hvd.init()
    init_s = time.monotonic() - began
    sums = []
    for step in range(5):
        if step == 2 and hvd.rank() == 1:
            time.sleep(args.hold)
        x = torch.arange(4, dtype=torch.float64) * (hvd.rank() + 1) + step
        sums.append(hvd.allreduce(x, op=hvd.Sum, name=f"step.{step}").tolist())
    print("REPORT " + json.dumps({"rank": hvd.rank(), "sums": sums, "init_s": init_s}), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
