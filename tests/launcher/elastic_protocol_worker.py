"""A worker that speaks the elastic contract directly (no hora.elastic): tests the driver alone.

Usage: elastic_protocol_worker.py OUTDIR

Each step (0.05 s) it appends a JSON line {wid, pid, gen, rank, size, step, env rank} to OUTDIR/steps.jsonl.
It resets (posts ready, waits for a newer world) when the board of its world says a rank ended (as a failed
collective would) or when the driver posted a host update after the world's. It leaves (exit 0) when a world after
its own does not hold it, and returns (exit 0) once OUTDIR/stop exists. OUTDIR/raise.<wid> makes it raise,
OUTDIR/kill.<wid> makes it SIGKILL itself (each file is consumed).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed import TCPStore

from hora.common import env as hora_env
from hora.protocol import elastic as ep
from hora.protocol import messages as protocol
from hora.protocol.signedstore import SignedStore

out = Path(sys.argv[1])
wid = os.environ[ep.WORKER_ID_ENV]
job = os.environ["HORA_JOB_ID"]
addr, port = os.environ["HORA_STORE_ADDR"], int(os.environ["HORA_STORE_PORT"])
store = SignedStore(TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=30)),
                    hora_env.job_secret(), job, f"{addr}:{port}")


def key(name: str, **fields: object) -> str:
    return ep.elastic_key(job, name, **fields)


def record(**fields: object) -> None:
    with open(out / "steps.jsonl", "a") as fh:
        fh.write(json.dumps({"wid": wid, "pid": os.getpid(), "start_rank": int(os.environ["HOROVOD_RANK"]),
                             "host": os.environ["HOROVOD_HOSTNAME"], **fields}) + "\n")


def join(last: int) -> ep.World:
    store.set(key(ep.READY, worker_id=wid), str(last))
    seen = last
    while True:
        if store.check([key(ep.GEN)]):
            gen = int(store.get(key(ep.GEN)))
            if gen > seen:
                world = ep.World.from_json(store.get(key(ep.WORLD, gen=gen)))
                if wid in world.workers:
                    return world
                if last > 0:
                    record(event="removed", gen=gen)
                    print(f"{wid}: not in world {gen}: leaving", flush=True)
                    sys.exit(0)
                seen = gen
        time.sleep(0.02)


def consume(name: str) -> bool:
    path = out / f"{name}.{wid}"
    if path.exists():
        path.unlink()
        return True
    return False


world = join(0)
step = 0
while True:
    rank = world.workers[wid].rank
    board = ep.world_job_id(job, world.gen)
    record(event="step", gen=world.gen, rank=rank, size=world.size, step=step)
    step += 1
    if (out / "stop").exists():
        record(event="done", gen=world.gen, rank=rank)
        sys.exit(0)
    if consume("raise"):
        raise RuntimeError(f"{wid}: injected failure")
    if consume("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
    ended = int(store.add(protocol.board_key(board, protocol.ENDS), 0))
    updated = store.check([key(ep.UPDATE, n=world.updates + 1)])
    if ended or updated:
        record(event="reset", gen=world.gen, rank=rank, why="ended" if ended else "updates")
        world = join(world.gen)
