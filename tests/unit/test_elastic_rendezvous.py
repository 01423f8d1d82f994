"""The worker's rendezvous with the elastic driver (hora.runtime.elastic_rendezvous), in one process."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from hora.common.env import WorkerEnv
from hora.errors import ElasticTimeoutError, StoreAuthError
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore
from hora.runtime import elastic_rendezvous as world

JOB = "j1"
BASE = f"hora/{JOB}/elastic/"
SECRET = JobSecret.generate()


def _store() -> SignedStore:
    """The job's store as the driver and the workers share it (every value authenticated)."""
    return SignedStore(dist.HashStore(), SECRET, JOB, "127.0.0.1:29500")


def _env(worker: str = "b:0") -> WorkerEnv:
    return WorkerEnv(rank=0, size=1, source="hora", job_id=JOB, elastic=True, worker_id=worker, hostname="b")


def _publish(store: SignedStore, gen: int, workers: list[str], updates: int = 0) -> None:
    members = {w: {"rank": r, "local_rank": 0, "local_size": 1, "cross_rank": r, "cross_size": len(workers),
                   "hostname": w.split(":")[0]} for r, w in enumerate(workers)}
    store.set(f"{BASE}world/{gen}", json.dumps({"gen": gen, "size": len(workers), "workers": members,
                                                "updates": updates}))
    store.set(f"{BASE}gen", str(gen))


def test_join_takes_rank_and_size_from_the_newest_world_and_posts_ready() -> None:
    store = _store()
    _publish(store, 1, ["a:0", "b:0"])
    env, joined = world.join(store, _env(), 0, timeout_s=5)
    assert (env.rank, env.size, env.cross_rank, env.cross_size, joined.gen, env.world_gen) == (1, 2, 1, 2, 1, 1)
    assert env.board_id == f"{JOB}/g1"  # each world has its own board: ranks are numbered afresh
    assert store.get(f"{BASE}ready/b:0") == b"0"


def test_a_new_worker_waits_for_a_world_that_holds_it() -> None:
    store = _store()
    _publish(store, 3, ["a:0"])  # the job is at world 3 when this worker starts: not a removal
    with pytest.raises(ElasticTimeoutError, match="--elastic-timeout"):
        world.join(store, _env(), 0, timeout_s=0.1)


def test_a_worker_left_out_of_the_next_world_exits_0() -> None:
    store = _store()
    _publish(store, 2, ["a:0"])
    with pytest.raises(SystemExit) as info:
        world.join(store, _env(), 1, timeout_s=5)
    assert info.value.code == 0


def test_a_worker_that_starts_while_the_job_runs_is_alone() -> None:
    store = _store()
    assert world.newest(store, JOB) == 0  # the job is starting: its workers join in init()
    _publish(store, 2, ["a:0"])
    assert world.newest(store, JOB) == 2
    start = WorkerEnv(rank=1, size=2, local_rank=1, local_size=2, cross_rank=0, cross_size=1, source="hora",
                      job_id=JOB, elastic=True, worker_id="b:1", hostname="b")
    env = world.alone(start)
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank, env.cross_size) == (0, 1, 1, 2, 0, 1)
    assert (env.elastic, env.source, env.board_id, env.worker_id) == (False, "single", "", "b:1")
    shown = world.planned(start)  # what hvd.rank(), hvd.size()... report until it joins: its start values
    assert (shown.rank, shown.size, shown.local_rank, shown.local_size, shown.cross_rank, shown.cross_size) == (
        1, 2, 1, 2, 0, 1)


def test_host_updates_say_whether_only_removals_happened() -> None:
    store = _store()
    assert world.host_updates(store, JOB, 0) == (0, True)
    for n, (added, removed) in enumerate([([], ["c"]), (["d"], [])], start=1):
        store.set(f"{BASE}update/{n}", json.dumps({"added": added, "removed": removed}))
    assert world.host_updates(store, JOB, 0) == (2, False)
    assert world.host_updates(store, JOB, 1) == (2, False)
    store.set(f"{BASE}update/3", json.dumps({"added": [], "removed": ["d"]}))
    assert world.host_updates(store, JOB, 2) == (3, True)


def test_records_a_stranger_wrote_are_refused_naming_their_key() -> None:
    store = _store()
    _publish(store, 1, ["a:0", "b:0"])
    store.raw.set(f"{BASE}world/1", store.seal("ignored", json.dumps({"gen": 1, "size": 1, "workers": {}})))
    with pytest.raises(StoreAuthError, match=f"store key '{BASE}world/1'"):  # a MAC made for another key
        world.join(store, _env(), 0, timeout_s=5)
    store.raw.add(f"{BASE}updates", 5)  # a counter a stranger bumps announces nothing
    assert world.host_updates(store, JOB, 0) == (0, True)
    store.raw.set(f"{BASE}update/1", json.dumps({"added": ["evil"], "removed": []}))
    with pytest.raises(StoreAuthError, match=f"store key '{BASE}update/1'"):
        world.host_updates(store, JOB, 0)
    store.raw.set(f"{BASE}discovered/1", json.dumps({"added": ["evil"], "removed": []}))
    with pytest.raises(StoreAuthError, match=f"store key '{BASE}discovered/1'"):
        world.discoveries(store, JOB, 0)


def test_an_older_gen_put_back_by_a_stranger_delays_no_worker() -> None:
    """Issue 33.5: ``gen`` is rewritten in place, so its older values keep valid MACs; a stranger replays one."""
    store = _store()
    _publish(store, 1, ["a:0", "b:0"])
    captured = store.raw.get(f"{BASE}gen")  # what a stranger reads while world 1 is the newest
    _publish(store, 2, ["a:0", "b:0", "c:0"])
    store.raw.set(f"{BASE}gen", captured)  # the replay: a value the driver really wrote, for this very key
    assert store.get(f"{BASE}gen") == b"1"  # its MAC checks: nothing but the worlds themselves can tell
    assert world.newest(store, JOB) == 2
    env, joined = world.join(store, _env(), 1, timeout_s=3)  # a member of world 1 after its reset
    assert (joined.gen, env.rank, env.size) == (2, 1, 3)
    store.raw.delete_key(f"{BASE}gen")  # deleted outright: the worlds still say which is the newest
    assert world.newest(store, JOB) == 2


def test_discoveries_are_read_after_the_count_already_seen() -> None:
    """The driver's ``discovered`` records (what rank 0 passes to Horovod's ``state.on_hosts_updated``)."""
    store = _store()
    assert world.discoveries(store, JOB, None) == (0, [])
    for n, (added, removed) in enumerate([(["b"], []), ([], ["a"])], start=1):
        store.set(f"{BASE}discovered/{n}", json.dumps({"added": added, "removed": removed}))
    assert world.discoveries(store, JOB, None) == (2, [])  # the count only: what came before is old news
    count, changes = world.discoveries(store, JOB, 1)
    assert count == 2 and [(c.added, c.removed) for c in changes] == [((), ("a",))]
