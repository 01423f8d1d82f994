"""timeline.py: Chrome-trace files per rank, valid JSON at every moment, merged into one."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hora.diagnostics import timeline as T
from tests.polling import wait_until


@pytest.fixture(autouse=True)
def _no_timeline_left_running():
    yield
    T.stop_timeline()


def _spans(events, pid=None):
    return [e for e in events if e["ph"] == "X" and (pid is None or e["pid"] == pid)]


def _row_names(events, pid):
    return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
            and e["pid"] == pid}


def test_off_by_default_and_after_stop(tmp_path):
    assert T.active() is None
    tl = T.start_timeline(str(tmp_path / "t.json"), rank=0, size=1)
    assert T.active() is tl
    T.stop_timeline()
    assert T.active() is None


def test_one_rank_file_has_its_row_phases_and_op_details(tmp_path):
    path = tmp_path / "t.json"
    tl = T.start_timeline(str(path), rank=3, size=4)
    assert json.loads((tmp_path / "t.rank3.json").read_text())  # valid from the start
    t0 = time.perf_counter()
    for i, phase in enumerate(T.PHASES):
        tl.span("grad.bucket.0", phase, t0 + i * 0.001, t0 + (i + 1) * 0.001, bytes=4096, dtype="float32",
                shape=[1024])
    tl.span("loss", "communicate", t0, t0 + 0.002, bytes=4, dtype="float32", shape=[])
    T.stop_timeline()
    assert not path.exists()  # a rank of a 4-rank job writes its own file only
    events = json.loads((tmp_path / "t.rank3.json").read_text())
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 3"}
    spans = _spans(events)
    assert {e["pid"] for e in spans} == {3}
    assert [e["name"] for e in spans][:6] == list(T.PHASES)
    rows = _row_names(events, 3)
    assert {rows[e["tid"]] for e in spans} == {"grad.bucket.0", "loss"}
    first = spans[0]
    assert first["args"] == {"bytes": 4096, "dtype": "float32", "shape": [1024], "name": "grad.bucket.0"}
    assert first["dur"] == pytest.approx(1000.0, abs=1.0)  # microseconds
    assert abs(first["ts"] / 1e6 - time.time()) < 60  # wall-clock microseconds, so ranks line up


def test_single_process_writes_the_path_itself(tmp_path):
    tl = T.start_timeline(str(tmp_path / "t.json"), mark_cycles=True, rank=0, size=1)
    assert tl.mark_cycles is True
    tl.instant("round", row="negotiator")
    tl.counter("pending", ops=3)
    T.stop_timeline()
    events = json.loads((tmp_path / "t.json").read_text())
    assert [(e["ph"], e["name"]) for e in events if e["ph"] in "iC"] == [("i", "round"), ("C", "pending")]
    assert [e["args"] for e in events if e["ph"] == "C"] == [{"ops": 3}]


def test_file_is_valid_json_while_running(tmp_path):
    tl = T.start_timeline(str(tmp_path / "t.json"), rank=0, size=1)
    t = time.perf_counter()
    for i in range(3):
        tl.span(f"op{i}", "communicate", t, t)
        tl.flush()
        events = json.loads((tmp_path / "t.json").read_text())
        assert len(_spans(events)) == i + 1


def test_many_threads_lose_no_event(tmp_path):
    tl = T.start_timeline(str(tmp_path / "t.json"), rank=1, size=1)

    def record(k: int) -> None:
        t = time.perf_counter()
        for i in range(700):  # crosses the flush-every-N-events threshold several times
            tl.span(f"thread{k}", "communicate", t, t, i=i)

    threads = [threading.Thread(target=record, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    T.stop_timeline()
    spans = _spans(json.loads((tmp_path / "t.json").read_text()))
    assert len(spans) == 2800
    for k in range(4):
        assert [e["args"]["i"] for e in spans if e["args"]["name"] == f"thread{k}"] == list(range(700))


def test_valid_json_after_sigkill_mid_run(tmp_path):
    path = str(tmp_path / "t.json")
    pid = os.fork()
    if pid == 0:  # child: record forever, flushing often, until killed
        try:
            tl = T.Timeline(path, rank=0)
            t = time.perf_counter()
            while True:
                tl.span("op", "communicate", t, t, payload="x" * 100)
                tl.flush()
        finally:
            os._exit(1)
    try:
        wait_until(lambda: os.path.exists(path) and os.path.getsize(path) >= 200_000, timeout=10)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    events = json.loads(Path(path).read_text())
    assert len(_spans(events)) > 500


def test_rank_path_naming():
    assert T.rank_path("/x/t.json", 3) == "/x/t.rank3.json"
    assert T.rank_path("trace", 0) == "trace.rank0"
    assert T.rank_path("/x/t.json", 3, job="3fa2c1") == "/x/t.3fa2c1.rank3.json"
    assert T.rank_path("/x/t.json", 0, job="run7/attempt1") == "/x/t.run7-attempt1.rank0.json"


def _rank_files(path, job, ranks, name="step"):
    for r in ranks:
        tl = T.Timeline(T.rank_path(path, r, job), rank=r)
        tl.span(name, "communicate", 0.0, 0.001)
        tl.close()


def test_each_job_merges_its_own_rank_files_and_an_empty_merge_keeps_the_existing_file(tmp_path):
    path = str(tmp_path / "t.json")
    _rank_files(path, "first", range(2), name="first")
    _rank_files(path, "second", range(2), name="second")  # a second job with the same path, at the same time
    assert T.finish_job_timeline(path, 2, job="first") == 2
    merged = Path(path).read_text()
    assert {e["args"]["name"] for e in _spans(json.loads(merged))} == {"first"}
    assert T.rank_parts(path, "second") == [T.rank_path(path, r, "second") for r in range(2)]
    assert T.finish_job_timeline(path, 2, job="third") == 0  # a job whose ranks wrote nothing
    assert Path(path).read_text() == merged  # ... does not write an empty timeline over the first's
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.second.rank0.json", "t.second.rank1.json"]


def test_a_merge_that_fails_on_a_full_disk_leaves_no_temporary_file_and_the_old_timeline(tmp_path, small_disk):
    disk = small_disk(16)
    out = disk / "t.json"
    out.write_text("[\n]\n")
    path = str(tmp_path / "t.json")
    for r in range(2):
        tl = T.Timeline(T.rank_path(path, r, "j"), rank=r)
        for i in range(300):  # ~60 KB per rank: more than the disk holds
            tl.span(f"op{i}", "communicate", 0.0, 0.001, note="x" * 100)
        tl.close()
    with pytest.raises(OSError, match="No space left on device"):
        T.merge_timelines([T.rank_path(path, r, "j") for r in range(2)], str(out))
    assert sorted(os.listdir(disk)) == ["t.json"]
    assert out.read_text() == "[\n]\n"


def test_merge_puts_every_rank_in_one_file(tmp_path):
    path = str(tmp_path / "job.json")
    for r in range(3):
        tl = T.Timeline(T.rank_path(path, r), rank=r)
        t = time.perf_counter()
        tl.span("grad.bucket.0", "negotiate", t, t + 0.001)
        tl.span("grad.bucket.0", "communicate", t + 0.001, t + 0.002)
        tl.close()
    assert T.finish_job_timeline(path, size=3) == 3  # ranks whose events were merged
    events = json.loads(Path(path).read_text())
    ranks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert ranks == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    for r in range(3):
        assert [e["name"] for e in _spans(events, r)] == ["negotiate", "communicate"]
        assert set(_row_names(events, r).values()) == {"grad.bucket.0"}
    assert sorted(os.listdir(tmp_path)) == ["job.json"]  # parts removed


def test_merge_skips_missing_and_repairs_truncated_files(tmp_path):
    good = tmp_path / "a.json"
    tl = T.Timeline(str(good), rank=0)
    tl.span("x", "communicate", 0.0, 0.001)
    tl.close()
    cut = tmp_path / "b.json"
    cut.write_text('[\n{"name":"process_name","ph":"M","pid":1,"tid":0,"args":{"name":"rank 1"}},\n{"name":"com')
    empty = tmp_path / "c.json"
    empty.write_text("[\n]\n")
    out = tmp_path / "out.json"
    n = T.merge_timelines([str(good), str(empty), str(cut), str(tmp_path / "missing.json")], str(out))
    events = json.loads(out.read_text())
    assert n == 2  # files that contributed events
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}


def test_unnamed_ops_share_a_few_rows_without_overlapping(tmp_path):
    tl = T.start_timeline(str(tmp_path / "t.json"), rank=0, size=1)
    for step in range(50):  # synchronous unnamed ops, one after the other: one row for all
        t = float(step)
        tl.span(f"noname.ps0.{step}", "negotiate", t, t + 0.1, kind="allreduce")
        tl.span(f"noname.ps0.{step}", "copy_out", t + 0.1, t + 0.2, kind="allreduce")
    # two async ones in flight together: a second lane
    tl.span("noname.ps0.50", "negotiate", 60.0, 61.0, kind="allreduce")
    tl.span("noname.ps0.51", "negotiate", 60.5, 61.5, kind="allreduce")
    tl.span("noname.ps0.50", "copy_out", 61.0, 61.1, kind="allreduce")
    tl.span("noname.ps0.51", "copy_out", 61.5, 61.6, kind="allreduce")
    tl.span("named", "negotiate", 0.0, 1.0, kind="allreduce")
    T.stop_timeline()
    events = json.loads((tmp_path / "t.json").read_text())
    rows = _row_names(events, 0)
    assert sorted(rows.values()) == ["named", "unnamed allreduce", "unnamed allreduce (2)"]
    lane = {e["args"]["name"]: rows[e["tid"]] for e in _spans(events)}
    assert {lane[f"noname.ps0.{s}"] for s in range(50)} == {"unnamed allreduce"}
    assert (lane["noname.ps0.50"], lane["noname.ps0.51"]) == ("unnamed allreduce", "unnamed allreduce (2)")


def test_command_line_merge_of_a_run_time_timeline(tmp_path, capsys):
    path = str(tmp_path / "t.json")
    for r in (0, 1, 10):
        tl = T.Timeline(T.rank_path(path, r), rank=r)
        tl.span("x", "communicate", 0.0, 0.001)
        tl.close()
    (tmp_path / "t.rankx.json").write_text("not a rank file")
    assert T.rank_parts(path) == [T.rank_path(path, r) for r in (0, 1, 10)]
    from hora.diagnostics.__main__ import _main  # python -m hora.diagnostics merge-timeline <path>

    assert _main(["merge-timeline", path]) == 0
    assert "events of 3 ranks" in capsys.readouterr().err
    events = json.loads(Path(path).read_text())
    assert sorted(e["pid"] for e in events if e["name"] == "process_name") == [0, 1, 10]
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.rankx.json"]
    assert T.main([str(tmp_path / "none.json")]) == 1


def test_command_line_merge_asks_which_job_when_several_left_files(tmp_path, capsys):
    path = str(tmp_path / "t.json")
    _rank_files(path, "aa11", range(2))
    _rank_files(path, "bb22", range(3))
    assert T.main([path]) == 1
    assert ("per-rank files of several jobs next to " + path + " (job ids: aa11, bb22); merge one job's with "
            "--job ID") in capsys.readouterr().err
    assert T.main([path, "--job", "bb22"]) == 0
    events = json.loads(Path(path).read_text())
    assert sorted(e["pid"] for e in events if e["name"] == "process_name") == [0, 1, 2]
    assert T.rank_parts(path) == [T.rank_path(path, r, "aa11") for r in range(2)]


def test_horovod_names_are_exported():
    import hora

    assert hora.start_timeline is T.start_timeline and hora.stop_timeline is T.stop_timeline


def test_merge_streams_big_files_event_for_event(tmp_path):
    path = str(tmp_path / "big.json")
    for r in range(2):
        tl = T.Timeline(T.rank_path(path, r), rank=r)
        for i in range(6000):  # several MB: the merge copies it in chunks without parsing it
            tl.span(f"op{i % 7}", "communicate", 0.0, 0.001, i=i, note="x" * 200)
        tl.close()
    T.finish_job_timeline(path, 2)
    events = json.loads(Path(path).read_text())
    for r in range(2):
        assert [e["args"]["i"] for e in events if e["pid"] == r and e["ph"] == "X"] == list(range(6000))


def test_a_forked_child_does_not_write_to_its_parents_timeline(tmp_path):
    path = tmp_path / "t.json"
    T.start_timeline(str(path), rank=0, size=1)
    pid = os.fork()
    if pid == 0:  # e.g. a DataLoader worker
        os._exit(0 if T.active() is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert T.active() is not None  # the parent's timeline goes on


def test_restarting_in_the_same_process_appends(tmp_path):
    # init() after shutdown() (elastic) restarts the timeline on the same file: earlier events stay
    path = tmp_path / "t.json"
    for gen in range(3):
        tl = T.start_timeline(str(path), rank=0, size=1)
        tl.span(f"gen{gen}", "communicate", 0.0, 0.001)
        T.stop_timeline()
        names = [e["args"]["name"] for e in json.loads(path.read_text()) if e["ph"] == "X"]
        assert names == [f"gen{g}" for g in range(gen + 1)]


def test_a_write_error_stops_the_timeline_not_the_training(tmp_path, monkeypatch, caplog):
    tl = T.start_timeline(str(tmp_path / "t.json"), rank=0, size=1)

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(T.os, "pwrite", full_disk)
    for i in range(2000):  # crosses the flush threshold on the caller's thread
        tl.span("x", "communicate", 0.0, 0.001, i=i)
    assert "No space left on device" in caplog.text


def test_an_unwritable_path_is_a_clear_config_error(tmp_path):
    from hora.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"rank 2 cannot write .*t\.rank2\.json.*writable directory"):
        T.start_timeline(str(blocker / "t.json"), rank=2, size=4)  # a file where a directory should be
    assert T.active() is None
