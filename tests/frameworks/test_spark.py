"""hora on a real Spark local-cluster (two executor JVMs): Spark's TorchDistributor running a hora function and a
hora file unchanged, and hora.spark.run (Horovod's horovod.spark.run); a rank that raises or is killed ends the
job at once, naming the rank and its host, and leaves nothing running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.frameworks import HERE, SparkDriver, gone, rank_files
from tests.frameworks.training import reference

pytestmark = pytest.mark.frameworks


def _same_params(results: list[dict]) -> None:
    expected = reference()
    for r in results:
        assert r["params"] == pytest.approx(expected, rel=1e-5, abs=1e-6), f"rank {r['rank']} differs"


def _ran(spark_driver: SparkDriver, script: str) -> None:
    reply = spark_driver.run(script)
    assert reply["ok"], reply.get("traceback", reply)


@pytest.mark.parametrize("form", ["function", "file"])
def test_torch_distributor_runs_a_hora_script_unchanged(spark_driver: SparkDriver, tmp_path: Path, form: str) -> None:
    target = "train" if form == "function" else repr(str(HERE / "training.py"))
    _ran(spark_driver, f"""
from pyspark.ml.torch.distributor import TorchDistributor
TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run({target}, {str(tmp_path)!r})
""")
    results = rank_files(tmp_path, 2)
    assert all(r["secret_file"] == str(spark_driver.tmp / "hora.secret") for r in results)  # spark.executorEnv
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["local_rank"] for r in results] == [0, 1] and results[0]["local_size"] == 2  # one machine
    _same_params(results)


def test_horovod_spark_run_returns_the_ranks_values_in_rank_order(spark_driver: SparkDriver, tmp_path: Path) -> None:
    _ran(spark_driver, f"""
import json, os, sys
import hora
sys.path.append(os.path.join(os.path.dirname(hora.__file__), "_compat"))
import horovod.spark  # the stand-in: hora.spark
values = horovod.spark.run(train, num_proc=2)
scaled = horovod.spark.run(lambda k, m=1: __import__("hora").init() or __import__("hora").rank() * k * m,
                           args=(10,), kwargs={{"m": 2}}, num_proc=2)
with open({str(tmp_path / "report.json")!r}, "w") as f:
    json.dump({{"values": values, "scaled": scaled}}, f)
""")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [v["rank"] for v in report["values"]] == [0, 1]
    _same_params(report["values"])
    assert report["scaled"] == [0, 20]


FAULT = """
import json, os, signal, threading, time

def work(fault, pid_dir):
    import torch
    import hora as hvd
    hvd.init()
    with open(f"{{pid_dir}}/pid{{hvd.rank()}}", "w") as f:
        f.write(f"{{os.getpid()}} {{os.getppid()}}")
    if hvd.rank() == 1 and fault == "raise":
        with open(f"{{pid_dir}}/raised", "w") as f:
            f.write(str(time.time()))
        raise ValueError("bad batch on rank 1")
    while True:  # rank 1 is killed from outside meanwhile
        hvd.allreduce(torch.ones(4))
        time.sleep(0.05)

killed = []

def kill_rank_1():
    while not os.path.exists("{tmp}/pid1"):
        time.sleep(0.1)
    time.sleep(1.0)
    os.kill(int(open("{tmp}/pid1").read().split()[0]), signal.SIGKILL)
    killed.append(time.time())

if "{fault}" == "kill":
    threading.Thread(target=kill_rank_1, daemon=True).start()
try:
    {call}
    error = None
except BaseException as e:
    error = e
ended = time.time()
while sc.statusTracker().getActiveStageIds() and time.time() < ended + 20:  # Spark stops the other tasks
    time.sleep(0.2)
with open("{tmp}/report.json", "w") as f:
    json.dump({{"type": type(error).__name__, "message": str(error), "cause": str(error.__cause__),
               "seconds": ended - (killed[0] if killed else float(open("{tmp}/raised").read())),
               "active_stages": list(sc.statusTracker().getActiveStageIds())}}, f)
"""


def _pids(tmp: Path) -> list[int]:
    """Each rank's process and its parent (the Spark task's Python worker, or torchrun's agent)."""
    return [int(p) for r in range(2) for p in (tmp / f"pid{r}").read_text().split()]


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_failed_rank_ends_hora_spark_run(spark_driver: SparkDriver, tmp_path: Path, fault: str) -> None:
    call = f"import hora.spark; hora.spark.run(work, args=({fault!r}, {str(tmp_path)!r}), num_proc=2)"
    _ran(spark_driver, FAULT.format(tmp=tmp_path, fault=fault, call=call))
    report = json.loads((tmp_path / "report.json").read_text())
    print(f"{fault}: hora.spark.run raised {report['type']} {report['seconds']:.1f} s after the fault")
    if fault == "raise":
        assert report["type"] == "ValueError" and report["message"] == "bad batch on rank 1"
        assert report["cause"].startswith("rank 1 on host ")
    else:
        assert report["type"] == "JobFailedError"
        assert report["message"].startswith("hora.spark.run: rank 1 on host "), report["message"]
        assert report["message"].endswith("failed: signal SIGKILL (9)") and "\n" not in report["message"]
    assert report["active_stages"] == [], "Spark tasks of the job are still running"
    ranks = [int((tmp_path / f"pid{r}").read_text().split()[0]) for r in range(2)]
    assert gone(ranks, within=20) == [], "a rank process is still running"


def test_a_killed_torch_distributor_process_ends_the_job(spark_driver: SparkDriver, tmp_path: Path) -> None:
    call = ("from pyspark.ml.torch.distributor import TorchDistributor; TorchDistributor(num_processes=2, "
            f"local_mode=False, use_gpu=False).run(work, 'kill', {str(tmp_path)!r})")
    _ran(spark_driver, FAULT.format(tmp=tmp_path, fault="kill", call=call))
    report = json.loads((tmp_path / "report.json").read_text())
    print(f"TorchDistributor raised {report['type']} {report['seconds']:.1f} s after the kill")
    # Spark's report: the barrier stage failed at task 1 (rank 1); the ranks' own lines are in the executor logs
    assert report["type"] == "Py4JJavaError", report
    assert "barrier" in report["message"] and "TorchDistributor failed during training" in report["message"]
    assert report["active_stages"] == [], "Spark tasks of the job are still running"
    assert gone(_pids(tmp_path), within=20) == [], "a rank process or its torchrun is still running"


def test_horovod_spark_run_times_out_when_the_cluster_has_too_few_slots(spark_driver: SparkDriver,
                                                                        tmp_path: Path) -> None:
    """4 ranks on a cluster of 2 task slots: Horovod's 'Timed out waiting for Spark tasks to start.' after
    start_timeout, nothing left running, and the cluster takes the next job."""
    _ran(spark_driver, f"""
import json, time
import hora.spark
from hora.errors import PlacementTimeoutError
began = time.monotonic()
try:
    hora.spark.run(lambda: 0, num_proc=4, start_timeout=5)
    outcome = "returned"
except TimeoutError as e:
    outcome = [type(e).__name__, isinstance(e, PlacementTimeoutError), str(e)]
took = time.monotonic() - began
after = hora.spark.run(lambda: 7, num_proc=2)
with open({str(tmp_path / "report.json")!r}, "w") as f:
    json.dump({{"outcome": outcome, "took": took, "after": after}}, f)
""")
    report = json.loads((tmp_path / "report.json").read_text())
    name, is_placement, message = report["outcome"]
    assert (name, is_placement) == ("PlacementTimeoutError", True)
    # a barrier stage starts all its tasks at once or none
    assert message.startswith("Timed out waiting for Spark tasks to start: 0 of 4 ranks' tasks started within "
                              "start_timeout=5 s")
    assert report["took"] < 120  # not Spark's own retries of the barrier stage
    assert report["after"] == [7, 7]


def test_horovod_spark_run_writes_the_ranks_output_to_the_given_streams(spark_driver: SparkDriver,
                                                                        tmp_path: Path) -> None:
    """As Horovod's do_test_happy_run: each rank's lines in the streams given, as [rank]<stdout>:line."""
    _ran(spark_driver, f"""
import io, json, sys
import hora.spark

def fn():
    import sys
    import hora as hvd
    hvd.init()
    print(f"running fn {{hvd.size()}}")
    print("error line", file=sys.stderr)
    return hvd.rank()

out, err = io.StringIO(), io.StringIO()
values = hora.spark.run(fn, num_proc=2, stdout=out, stderr=err)
stamped = io.StringIO()
hora.spark.run(lambda: print("hello"), num_proc=1, stdout=stamped, prefix_output_with_timestamp=True)
with open({str(tmp_path / "report.json")!r}, "w") as f:
    json.dump({{"values": values, "out": out.getvalue(), "err": err.getvalue(), "stamped": stamped.getvalue()}}, f)
""")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["values"] == [0, 1]
    assert sorted(line for line in report["out"].splitlines() if "running fn" in line) == [
        "[0]<stdout>:running fn 2", "[1]<stdout>:running fn 2"]
    assert sorted(line for line in report["err"].splitlines() if "error line" in line) == [
        "[0]<stderr>:error line", "[1]<stderr>:error line"]
    assert "<stderr>" not in report["out"] and "<stdout>" not in report["err"]
    line = next(x for x in report["stamped"].splitlines() if x.endswith("[0]<stdout>:hello"))
    assert len(line) > len("[0]<stdout>:hello") + 20  # time.asctime() before it
