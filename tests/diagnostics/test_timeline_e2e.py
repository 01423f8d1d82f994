"""The timeline for real: a 2-rank job with HORA_TIMELINE set writes one row per rank with every phase."""

from __future__ import annotations

import json
import os

import torch

import hora as hvd
from hora.common.env import WorkerEnv
from hora.diagnostics import timeline as T
from tests.distributed.harness import run_ranks


def _train_a_little(rank: int, size: int) -> tuple[str, str]:
    torch.manual_seed(0)
    hvd.allreduce(torch.ones(4), name="loss")
    hvd.allreduce(torch.ones(2, 3, dtype=torch.float64))  # unnamed
    hvd.synchronize(hvd.allgather_async(torch.ones(2, 2), name="gathered"))
    hvd.broadcast(torch.ones(5), root_rank=0, name="weights")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 8)).sum().backward()
        opt.step()
    tl = T.active()
    return ("" if tl is None else tl.path), WorkerEnv.from_environ().job_id


def _events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rows(events: list[dict], pid: int) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


def test_two_rank_job_writes_a_row_per_rank_with_phases_and_op_details(tmp_path):
    path = str(tmp_path / "trace.json")
    results = run_ranks(_train_a_little, 2, env={"HORA_TIMELINE": path, "HORA_TIMELINE_MARK_CYCLES": "1"})
    paths, job = [p for p, _ in results], results[0][1]
    assert job and paths == [T.rank_path(path, 0, job), T.rank_path(path, 1, job)]  # the job's id in the names
    for rank in range(2):
        events = _events(paths[rank])  # each rank's own file is valid JSON
        assert {e["pid"] for e in events} == {rank}
        assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [f"rank {rank}"]
        rows = _rows(events, rank)
        spans = [e for e in events if e["ph"] == "X"]
        by_row: dict[str, set[str]] = {}
        for e in spans:
            by_row.setdefault(rows[e["tid"]], set()).add(e["name"])
        for name in ("loss", "gathered", "weights", "unnamed allreduce"):
            assert {"negotiate", "communicate", "copy_out"} <= by_row[name], (name, by_row.get(name))
        assert "copy_in" in by_row["loss"]  # allreduce copies the input into its wire buffer
        assert not [r for r in by_row if r.startswith("noname.")]  # unnamed ops share pooled rows
        buckets = [r for r in by_row if ".bucket." in r]
        assert buckets, sorted(by_row)  # optimizer buckets are rows of their own, named as buckets
        # and show the bucket's own copies: gradients in during backward, reduced gradients out
        assert all({"copy_in", "negotiate", "communicate", "copy_out"} <= by_row[b] for b in buckets), by_row
        fills = [e["args"].get("param") for e in spans if rows[e["tid"]] in buckets and e["name"] == "copy_in"]
        assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= set(fills), fills
        loss = next(e for e in spans if rows[e["tid"]] == "loss" and e["name"] == "communicate")
        assert (loss["args"]["dtype"], loss["args"]["shape"]) == ("float32", [4])
        assert loss["args"]["bytes"] == 16
        assert any(e["ph"] == "i" and e["name"] == "round" for e in events)  # --timeline-mark-cycles
    T.finish_job_timeline(path, 2, job=job)
    merged = _events(path)
    assert {e["args"]["name"] for e in merged if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]
