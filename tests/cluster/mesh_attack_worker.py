"""The training script of the mesh attack test: a real job whose ranks leave an attacker time to act.

    python mesh_attack_worker.py DIR

Two ranks are slowed at chosen points, so that an attacker on the network meets every listener of the
control mesh while it is open, deterministically (test scaffolding; hora itself is not changed):

- rank 2 holds back the PROOF of its handshake with rank 0 until ``DIR/replay-ready`` appears (at most 8 s),
  so that an attacker who captured its HELLO on the wire can replay it while rank 2's seat is still free;
- rank 3 reaches the mesh only once ``DIR/attack-done`` appears (at most 90 s). Before waiting it writes
  ``DIR/mesh.json``: the listeners of ranks 0-2 and the world's name, as an attacker reads them from the store.
  Then it times its own connections to the three listeners (each under attack): ``mesh_s`` in its report.

Every rank then allreduces ``rank + 1`` and prints ``REPORT {json}`` (rank, sum, mesh_s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hora as hvd
from hora.engine.auth import handshake
from hora.engine.transport import plane as control


def _wait_for(path: Path, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def hold_first_proof(folder: Path) -> None:
    """Rank 2: its first PROOF (to rank 0) waits for the attacker's replay."""
    real = handshake._send
    held = [False]

    def send(sock: Any, kind: int, body: bytes) -> None:
        if kind == handshake.PROOF and not held[0]:
            held[0] = True
            _wait_for(folder / "replay-ready", 8.0)
        real(sock, kind, body)

    handshake._send = send  # type: ignore[assignment]


def arrive_late(folder: Path, timings: dict[str, float]) -> None:
    """Rank 3: publish the listeners, wait for the attacker, then time the real connections."""
    real = control.connect_mesh

    def connect(me: Any, size: int, store: Any, *args: Any, **kwargs: Any) -> Any:
        listeners = {}
        for peer in range(size - 1):
            store.wait([f"mesh/{peer}"])
            listeners[peer] = store.get(f"mesh/{peer}").decode()
        out = folder / "mesh.json"
        (folder / "mesh.tmp").write_text(json.dumps({"world": me.world, "listeners": listeners}))
        (folder / "mesh.tmp").rename(out)
        _wait_for(folder / "attack-done", 90.0)
        start = time.monotonic()
        mesh = real(me, size, store, *args, **kwargs)
        timings["mesh_s"] = time.monotonic() - start
        return mesh

    control.connect_mesh = connect  # type: ignore[assignment]


def main() -> int:
    folder = Path(sys.argv[1])
    rank = int(os.environ["HORA_RANK"])
    timings: dict[str, float] = {}
    if rank == 2:
        hold_first_proof(folder)
    if rank == 3:
        arrive_late(folder, timings)
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="after-attack").item()
    print("REPORT " + json.dumps({"rank": hvd.rank(), "sum": total, **timings}), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
