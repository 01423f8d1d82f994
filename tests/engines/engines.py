"""The engines the tests in this folder start once per session, and how a test runs a driver script on them.

* Ray: a real two-node cluster (``ray.cluster_utils.Cluster``: a head node and a second raylet playing a second
  host, 2 CPUs each). Each test's driver is a script in its own Python process, connected by address: the
  pytest process never becomes a Ray driver (fork-started ranks elsewhere must not inherit Ray's threads).
* Spark: one driver process holding a SparkContext on ``local-cluster[2,1,1024]`` (two executor JVMs). A Spark
  local-cluster lives inside its driver, so tests send it scripts to run (:class:`SparkDriver`) instead of
  starting their own.

A missing engine (ray, pyspark, java) skips these tests with the reason, except under CI (``CI=true``), where it
is a failure: CI installs all of them (requirements-dev.txt, ``make system-deps``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
TRAINING = (HERE / "training.py").read_text()


def require(what: str, missing: bool, fix: str) -> None:
    """Skip (fail under CI) when ``missing``."""
    if not missing:
        return
    reason = f"{what} is not installed ({fix})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}: CI must run the engine tests", pytrace=False)
    pytest.skip(reason)


def module_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def run_driver(script: str, tmp: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``TRAINING + script`` as a driver program in its own process; output captured (text)."""
    path = tmp / "driver.py"
    path.write_text(TRAINING.replace('if __name__ == "__main__":', "if False:") + "\n" + script)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def gone(pids: list[int], within: float) -> list[int]:
    """The pids still alive after waiting up to ``within`` seconds for them to end."""
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def rank_files(out: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


class RayCluster:
    """A head node and a second node, started with the session and stopped at its end."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.tmp = tempfile.mkdtemp(prefix="hora-ray-")  # short: Ray's socket paths must fit in 107 bytes
        self.cluster = Cluster(initialize_head=True, connect=False,
                               head_node_args={"num_cpus": 2, "include_dashboard": False, "temp_dir": self.tmp})
        self.cluster.add_node(num_cpus=2)
        self.cluster.wait_for_nodes()
        self.address = self.cluster.address

    def shutdown(self) -> None:
        try:
            self.cluster.shutdown()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


SPARK_SERVER = r'''
import json, os, runpy, sys, traceback
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # everything else printed (ours, the JVM's) goes to the log, not the request channel
sys.stdout = sys.stderr
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("hora-tests")
         .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
         .config("spark.python.worker.reuse", "true").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
spark.sparkContext.parallelize(range(2), 2).count()  # both executors up
print("READY", file=proto)
for line in sys.stdin:
    request = json.loads(line)
    try:
        runpy.run_path(request["script"], init_globals={"spark": spark, "sc": spark.sparkContext}, run_name="__main__")
        reply = {"ok": True}
    except BaseException as e:
        reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    print(json.dumps(reply), file=proto)
'''


class SparkDriver:
    """A driver process with a SparkContext on local-cluster[2,1,1024]; runs the scripts tests send it."""

    def __init__(self, tmp: Path, start_timeout: float = 240.0) -> None:
        self.tmp = tmp
        self.log_path = tmp / "spark-driver.log"
        (tmp / "server.py").write_text(SPARK_SERVER)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(tmp / "server.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=tmp,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = self._line(start_timeout)
        if line != "READY":
            self.shutdown()
            raise RuntimeError(f"the Spark driver did not start: {line!r}; see {self.log_path}")
        self.runs = 0

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return f"<nothing within {timeout:.0f} s>"
        return self.proc.stdout.readline().strip()

    def run(self, script: str, timeout: float = 180.0) -> dict[str, Any]:
        """Run ``TRAINING + script`` in the driver (globals ``spark``, ``sc``); its reply ``{"ok", "error"}``."""
        assert self.proc.stdin is not None
        self.runs += 1
        path = self.tmp / f"job{self.runs}.py"
        path.write_text(TRAINING.replace('if __name__ == "__main__":', "if False:") + "\n" + script)
        self.proc.stdin.write(json.dumps({"script": str(path)}) + "\n")
        self.proc.stdin.flush()
        line = self._line(timeout)
        if not line.startswith("{"):
            raise AssertionError(f"the Spark driver gave no answer ({line}); its log: {self.log_path}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the server leaves its loop and Python stops the SparkContext at exit
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


def java_missing() -> bool:
    return shutil.which("java") is None
