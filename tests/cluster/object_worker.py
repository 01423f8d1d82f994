"""The training script of the data-plane attack: rank 0 broadcasts a state with broadcast_object, as
broadcast_optimizer_state and the elastic state sync do; each rank prints what it got.

    python object_worker.py

Prints ``REPORT {json}``: the rank, and the state's keys or the error the broadcast raised.
"""

from __future__ import annotations

import json
import sys

import torch

import hora as hvd


def main() -> int:
    hvd.init()
    hvd.allreduce(torch.ones(1), name="warm-up")  # the data plane's connections, through the stranger
    state = {"exp_avg": torch.arange(64.0), "step": 7, "note": "x" * 400} if hvd.rank() == 0 else None
    try:
        got = hvd.broadcast_object(state, root_rank=0, name="state")
        report = {"rank": hvd.rank(), "keys": sorted(got)}
    except Exception as e:  # noqa: BLE001 - what the rank raised is the report
        report = {"rank": hvd.rank(), "error": f"{type(e).__name__}: {e}"}
    print("REPORT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
