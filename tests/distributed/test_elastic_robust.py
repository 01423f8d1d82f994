"""hora.elastic when a member of a new world dies before that world stands (the launcher's driver is played by
process 0, as in test_elastic.py).

The launcher publishes a world, then one of its members dies before reaching ``init()``'s rendezvous: the
launcher posts ``ended/<rank>`` on that world's board. The other members must give up on that world at once
(not after ``--start-timeout``, set to 600 s here so that waiting for it fails the test by the harness's
deadline), post ready again and go on in the next world, with no committed step lost or repeated.
"""

from __future__ import annotations

import os
import time
from typing import Any

from hora.protocol import elastic as ep
from hora.protocol import messages as protocol
from tests.distributed.harness import run_ranks
from tests.distributed.test_elastic import _check_training, _Driver, _key, _signal_and_wait, _worker


def _post_ended(d: _Driver, job: str, gen: int, rank: int, how: str) -> None:
    """What ``hora run``'s elastic driver does when a member of the newest world ends."""
    board = ep.world_job_id(job, gen)
    d.store.set(protocol.board_key(board, protocol.ENDED, rank=rank), how)
    d.store.add(protocol.board_key(board, protocol.ENDS), 1)
    d.store.set(ep.arrivals_key(job, gen), ep.MEMBER_ENDED)


def _member_dies_before_setup(rank: int, size: int) -> Any:
    if rank == 0:
        d = _Driver()
        job = os.environ["HORA_JOB_ID"]
        workers = ["h1:0", "h2:0"]
        d.wait_ready(workers, 0)
        d.publish(1, workers)
        d.wait_key(_key("at"))
        d.host_update(added=["h3"], removed=[])  # h3:0 posted ready (no process plays it here) ...
        d.store.set(_key("go"), "1")
        d.wait_ready(workers, 1)
        d.publish(2, [*workers, "h3:0"])  # ... and dies right after world 2 is published
        for r in (0, 1):  # the survivors wait in world 2's rendezvous
            d.wait_key(f"{ep.world_prefix(job, 2)}/arrived/{r}")
        time.sleep(0.5)
        _post_ended(d, job, 2, 2, "signal SIGKILL (9)")
        d.wait_ready(workers, 2)  # they gave up world 2 and posted ready again
        d.publish(3, workers)
        return "driver"
    return _worker(f"h{rank}:0", _signal_and_wait(2))


def test_a_member_dying_before_the_new_world_stands_makes_the_others_join_the_next_one() -> None:
    results = run_ranks(_member_dies_before_setup, 3, init=False, timeout=120, env={"HORA_START_TIMEOUT": "600"})
    workers = results[1:]
    assert [(r["rank"], r["size"], r["gen"]) for r in workers] == [(0, 2, 3), (1, 2, 3)]
    assert workers[0]["resets"] == [2]  # one reset (at the commit), however many worlds it took
    _check_training(workers, [2])
