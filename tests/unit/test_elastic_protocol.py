"""The elastic contract's records and rank assignment (hora.protocol.elastic)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hora.launcher.hosts import assign_slots, parse_hosts
from hora.launcher.remote.transport import BOOTSTRAP
from hora.protocol import elastic as ep
from hora.protocol import messages as protocol


def _members(*ids: str) -> list[tuple[str, str]]:
    return [(wid, ep.parse_worker_id(wid)[0]) for wid in ids]


def test_first_world_numbers_like_a_fixed_job() -> None:
    world = ep.assign_world(None, 1, _members("a:0", "a:1", "b:0", "b:1", "c:0"))
    fixed = assign_slots(parse_hosts("a:2,b:2,c:1"), 5)
    got = [(p.rank, p.local_rank, p.local_size, p.cross_rank, p.cross_size, p.hostname) for _, p in world.ordered()]
    want = [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.hostname) for s in fixed]
    assert got == want
    assert world.size == 5 and world.gen == 1 and world.hosts() == ["a", "b", "c"]


def test_survivors_keep_their_order_and_come_first() -> None:
    w1 = ep.assign_world(None, 1, _members("a:0", "a:1", "b:0", "b:1"))
    # b:0 died (b blacklisted), c joined; members are passed in an arbitrary order
    w2 = ep.assign_world(w1, 2, _members("c:0", "c:1", "a:1", "a:0"))
    assert w2.worker_ids() == ["a:0", "a:1", "c:0", "c:1"]
    # the old rank 2 and 3 gone, a survivor from the second host becomes rank 0
    w3 = ep.assign_world(w2, 3, _members("c:1", "d:0", "c:0"))
    assert w3.worker_ids() == ["c:0", "c:1", "d:0"]
    assert w3.rank_of("d:0") == 2 and w3.rank_of("a:0") is None


def test_local_and_cross_ranks_when_a_host_grows_after_others() -> None:
    w1 = ep.assign_world(None, 1, _members("a:0", "b:0"))
    w2 = ep.assign_world(w1, 2, _members("a:0", "b:0", "a:1"))  # a's new slot is numbered after b
    p = w2.workers
    assert [p[w].rank for w in ("a:0", "b:0", "a:1")] == [0, 1, 2]
    assert (p["a:1"].local_rank, p["a:1"].local_size, p["a:1"].cross_rank, p["a:1"].cross_size) == (1, 2, 0, 1)
    assert (p["b:0"].local_rank, p["b:0"].local_size, p["b:0"].cross_rank, p["b:0"].cross_size) == (0, 1, 1, 2)


def test_world_and_update_json_round_trip() -> None:
    world = ep.assign_world(None, 7, _members("[::1]:0", "[::1]:1", "node-2:0"), updates=4)
    text = world.to_json()
    assert ep.World.from_json(text).updates == 4
    assert ep.World.from_json(text) == world
    assert ep.World.from_json(text.encode()) == world
    assert '"gen":7' in text and '"size":3' in text
    update = ep.Update(added=("c",), removed=("a", "b"))
    assert ep.Update.from_json(update.to_json()) == update
    assert not update.skip_sync and ep.Update(removed=("a",)).skip_sync
    assert ep.skip_sync([ep.Update(removed=("a",)), ep.Update(removed=("b",))])
    assert not ep.skip_sync([ep.Update(removed=("a",)), ep.Update(added=("b",))])


def test_bad_records_are_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        ep.assign_world(None, 1, _members("a:0", "a:0"))
    with pytest.raises(ValueError, match="not 0..size-1"):
        ep.World.from_json('{"gen":1,"size":1,"workers":{"a:0":{"rank":1,"local_rank":0,"local_size":1,'
                           '"cross_rank":0,"cross_size":1,"hostname":"a"}}}')
    with pytest.raises(ValueError, match="worker id"):
        ep.parse_worker_id("nohost")


def test_key_names() -> None:
    assert ep.elastic_key("j1", ep.GEN) == "hora/j1/elastic/gen"
    assert ep.elastic_key("j1", ep.WORLD, gen=3) == "hora/j1/elastic/world/3"
    assert ep.elastic_key("j1", ep.READY, worker_id="a:1") == "hora/j1/elastic/ready/a:1"
    assert ep.elastic_key("j1", ep.UPDATE, n=2) == "hora/j1/elastic/update/2"
    assert ep.world_prefix("j1", 4) == "hora/j1/g4"
    assert protocol.board_key(ep.world_job_id("j1", 4), protocol.ENDED, rank=2) == "hora/j1/g4/board/ended/2"


def test_stdlib_only() -> None:
    """Imported without the hora package's own imports (as the agent loads hora: transport.BOOTSTRAP), the
    module pulls in nothing outside the standard library."""
    code = (BOOTSTRAP.rsplit("\n", 1)[0] + "\nimport hora.protocol.elastic\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') or "
            "m.startswith('hora.') and m not in ('hora.protocol', 'hora.protocol.elastic'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
