"""The training script of the cluster tests: hvd.init, one real allreduce, then report or keep going.

python worker.py report            print one ``REPORT {json}`` line (rank, topology, hostname, sum), exit 0
python worker.py loop DIR          after the first allreduce write ``DIR/ready.<rank>`` (json, with the pid),
                                   then allreduce every 0.1 s until something kills the job
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

import hora as hvd


def main() -> int:
    mode = sys.argv[1]
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="first")
    report = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "hostname": socket.gethostname(),
        "sum": total.item(),
        "pid": os.getpid(),
        "horovod_hostname": os.environ.get("HOROVOD_HOSTNAME"),
    }
    if mode == "report":
        print("REPORT " + json.dumps(report), flush=True)
        hvd.shutdown()
        return 0
    ready = Path(sys.argv[2]) / f"ready.{hvd.rank()}"
    tmp = ready.parent / f"{ready.name}.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(ready)  # readers never see half a file
    step = 0
    while True:
        step += 1
        hvd.allreduce(torch.ones(4), op=hvd.Sum, name=f"step.{step}")
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
