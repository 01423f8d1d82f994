"""``hora bench control`` on 4 ranks: its counts are the values hora's design gives (a mesh round is one frame
to and from every peer; torch's Gloo groups connect lazily, so init reads two neighbours' addresses whatever
the size; the mesh reads every lower rank's address), the store counter counts what a store is asked, and the
projection reads the record back (``--from``) with a sweep's link. The 8-128-rank runs are benchmarks, not tests
(docs/performance.md, "Scale")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore

from hora.bench import cli, control, projection
from hora.bench.store_tally import StoreTally

N = 4


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return control.measure(control.ControlConfig(ranks=(2, N), planes=("tcp",), ops=3, elastic=True, timeout_s=120,
                                                 cost_ops=20))


def test_store_tally_counts_operations_keys_and_bytes() -> None:
    tally = StoreTally("job7")
    store = tally.wrap(HashStore())
    store.set("hora/job7/g1/mesh/0", "10.0.0.5:4100")
    store.set("hora/job7/g1/mesh/1", "10.0.0.6:4100")
    assert store.check(["hora/job7/g1/mesh/0", "hora/job7/g1/mesh/1"])
    assert store.get("hora/job7/g1/mesh/1") == b"10.0.0.6:4100"
    assert store.add("hora/job7/board/ends", 2) == 2
    counts = tally.take()
    assert counts.by_op() == {"add": 1, "check": 1, "get": 1, "set": 2}
    assert counts.by_family() == {"board": 1, "mesh": 4}
    assert counts.keys == 6  # the check named two
    assert counts.patterns[("set", "hora/<job>/g#/mesh/#")] == 2
    assert counts.bytes_in == len(b"10.0.0.6:4100") + 8
    assert tally.take().ops == 0  # take() starts over


def test_a_mesh_round_is_one_frame_to_and_from_every_peer(record: dict[str, Any]) -> None:
    row = next(r for r in record["rows"] if r["job"] == "fixed/tcp" and r["ranks"] == N)
    assert row["plane"] == "tcp"
    for phase in ("cold", "warm"):
        counts = row[phase]
        assert counts["exact"] and counts["rounds_agree"]
        assert counts["msgs_out_per_rank"] == counts["msgs_in_per_rank"] == N - 1
        assert counts["peers_talked_per_rank"] == N - 1
        assert counts["store_ops_total"] == 0  # the mesh rounds never touch the store
    assert row["cold"]["bytes_per_rank"] > row["warm"]["bytes_per_rank"]  # the cache sends names as integers


def test_init_counts_are_torch_s_rendezvous_and_the_mesh_s_addresses(record: dict[str, Any]) -> None:
    row = next(r for r in record["rows"] if r["job"] == "fixed/tcp" and r["ranks"] == N)
    store = row["init"]["store"]
    # three Gloo groups (the default one, the control group, the global process set's) each publish this
    # rank's address; they connect lazily, so only the control group's ring (the topology's allgather) reads
    # two neighbours' (a wait and a get each), whatever N; the arrivals: a set, an add, a wait and a get, and
    # one release by the last rank; the mesh: each rank but the last publishes its address and reads every
    # lower one's
    assert store["by_family_per_rank"]["torch"] == 3 + 2 * 2
    assert store["by_family_per_rank"]["arrival"] == 4 + 1 / N
    assert store["by_family_per_rank"]["mesh"] == ((N - 1) + N * (N - 1)) / N
    census = row["init"]["census"]
    assert census["peer_sockets_per_rank"] == (N - 1) + 2  # the mesh's, and the control group's ring neighbours'

    assert census["py_threads_rank0"]["hora-negotiator"] == census["py_threads_rank0"]["hora-timers"] == 1
    assert row["shutdown"]["threads_left_collected_per_rank"] == 0


def test_elastic_reset_is_counted_on_both_sides(record: dict[str, Any]) -> None:
    row = next(r for r in record["rows"] if r["job"] == "elastic" and r["ranks"] == N)
    assert row["exact"] and row["reset"]["worlds"] == [2]
    # the world's record names every rank's host: no topology allgather, so the three groups' addresses only
    assert row["reset"]["store"]["by_family_per_rank"]["torch"] == 3
    assert row["reset"]["store"]["by_family_per_rank"]["arrival"] == 4 + 1 / N
    # ready, a look at gen, a wait for the next world (no polling: the same count however long it waits), the
    # look at gen it woke up for and the record (one more look for a worker woken between the driver's two writes)
    assert 6 <= row["reset"]["store"]["by_family_per_rank"]["elastic"] <= 12
    driver = row["driver"]["reset"]
    assert driver["store"]["by_op"]["set"] == 2  # the world record and its number
    assert driver["store"]["by_op"]["check"] >= N  # every worker's ready key, at least once


def test_projection_reads_the_record_back_with_a_sweep(record: dict[str, Any], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    source, sweep, out = tmp_path / "control.json", tmp_path / "sweep.json", tmp_path / "projected.json"
    source.write_text(json.dumps(record, default=str))
    sweep.write_text(json.dumps({"kind": "allreduce", "ranks": 2, "hosts": 2, "ranks_per_host": [1, 1],
                                 "rows": [{"size": s, "ranks": 2, "raw": {"time_s": 1e-4 + s * 1e-9}}
                                          for s in (1024, 1 << 20, 16 << 20)]}))
    assert cli.main(["control", "--from", str(source), "--sweep", str(sweep), "--project", "1024",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 4 | tcp | 6 (6) |" in text  # the measured table, warm (cold) messages per rank per round
    assert "alpha 50 µs" in text  # a ring of 2: T = 2 alpha + S beta
    projected = json.loads(out.read_text())["projection"]
    mesh = projected["targets"][0]["planes"]["tcp"]
    assert mesh["msgs_per_rank_round"]["warm"] == pytest.approx(2 * 1023)  # 2(n-1), fitted to 2 and 4 ranks
    assert projected["fits"]["tcp"]["msgs_warm"]["formula"]


def test_fit_recovers_the_polynomial_of_exact_counts() -> None:
    ns = [8, 16, 32, 64, 128]
    mesh = projection.Fit.fit(ns, [2 * (n - 1) for n in ns])
    assert mesh.degree == 1 and mesh(4096) == pytest.approx(2 * 4095)
    total = projection.Fit.fit(ns, [n * (7 * n + 4) for n in ns])
    assert total.degree == 2 and total(4096) == pytest.approx(4096 * (7 * 4096 + 4))
    threads = projection.Fit.fit(ns, [11] * 5)
    assert threads.degree == 0 and threads(4096) == pytest.approx(11)


def test_counts_between_a_constant_and_a_line_are_fitted_in_log2_n() -> None:
    ns = [8, 16, 32, 64, 128]
    per_rank = projection.Fit.fit(ns, [12 + math.log2(n) for n in ns])  # e.g. store operations at init
    assert per_rank.log and per_rank(4096) == pytest.approx(24)
    assert per_rank.formula() == "12 + 1 log2(n)"
