"""A worker that looks for its job's secret everywhere a process can see on this machine, then stalls or fails.

    python secret_worker.py DIR stall|raise

Each rank writes ``DIR/scan.<rank>`` (JSON): the secret it was given (``HORA_SECRET``), its pid, the processes
whose command line holds the secret, and those whose environment does (pid and command). Then ``stall``:
rank 1 never reaches the second allreduce, so the stall inspector reports and, past the shutdown time, the
job fails; ``raise``: rank 1 raises after the first allreduce.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

import hora as hvd


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # the process ended meanwhile, or is not ours to read
        return b""


def scan(secret: bytes) -> dict[str, list[dict[str, object]]]:
    found: dict[str, list[dict[str, object]]] = {"cmdline": [], "environ": []}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        cmdline = _read(f"/proc/{name}/cmdline")
        where = {"pid": int(name), "cmdline": cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]}
        if secret in cmdline:
            found["cmdline"].append(where)
        if secret in _read(f"/proc/{name}/environ"):
            found["environ"].append(where)
    return found


def main() -> int:
    where, mode = Path(sys.argv[1]), sys.argv[2]
    secret = os.environ["HORA_SECRET"]
    hvd.init()
    logging.getLogger("hora.test").warning("rank %d: initialised", hvd.rank())
    report = {"secret": secret, "pid": os.getpid(), **scan(secret.encode())}
    (where / f"scan.{hvd.rank()}").write_text(json.dumps(report))
    hvd.allreduce(torch.ones(2), name="first")
    if hvd.rank() == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 gives up (a failure the launcher reports)")
        time.sleep(120)  # never reaches "second": its peers stall, the job ends at the stall shutdown time
    hvd.allreduce(torch.ones(2), name="second")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
