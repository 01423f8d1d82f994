"""The cluster frameworks the tests in this folder start once per session, and how a test runs a driver script on them.

* Ray: a real two-node cluster (``ray.cluster_utils.Cluster``: a head node and a second raylet playing a second
  host, 2 CPUs each). Each test's driver is a script in its own Python process, connected by address: the
  pytest process never becomes a Ray driver (fork-started ranks elsewhere must not inherit Ray's threads).
* Spark: one driver process holding a SparkContext on ``local-cluster[2,1,1024]`` (two executor JVMs). A Spark
  local-cluster lives inside its driver, so tests send it scripts to run (:class:`SparkDriver`) instead of
  starting their own.

Both frameworks run under a :class:`Keeper`, outside pytest's process tree.

A missing framework (ray, pyspark, java) skips these tests with the reason, except under CI (``CI=true``), where it
is a failure: CI installs all of them (requirements-dev.txt, ``make system-deps``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.polling import wait_until

HERE = Path(__file__).resolve().parent
TRAINING = (HERE / "training.py").read_text()


def require(what: str, missing: bool, fix: str) -> None:
    """Skip (fail under CI) when ``missing``."""
    if not missing:
        return
    reason = f"{what} is not installed ({fix})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}: CI must run the framework tests", pytrace=False)
    pytest.skip(reason)


def module_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def run_driver(script: str, tmp: Path, timeout: float,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``TRAINING + script`` as a driver program in its own process; output captured (text)."""
    path = tmp / "driver.py"
    path.write_text(TRAINING.replace('if __name__ == "__main__":', "if False:") + "\n" + script)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0",
                                        **(env or {})})


def gone(pids: list[int], within: float) -> list[int]:
    """The pids still alive after waiting up to ``within`` seconds for them to end."""
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=within, step=0.1)
    return [p for p in pids if _alive(p)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def rank_files(out: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


DETACH = ("import os, sys\nif os.fork():\n    os._exit(0)\nos.setsid()\n"
          "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")


class Keeper:
    """A Python program that keeps a framework up for the session, detached from pytest's process tree (a double
    fork, a session of its own): the framework's processes (Ray's workers, Spark's executors and Python workers)
    come and go as tests run, and must not count as processes a test left behind. It talks on its stdin and
    stdout; when its stdin closes (the session ends, or pytest died) it stops its framework and exits."""

    def __init__(self, program: str, tmp: Path, name: str, start_timeout: float) -> None:
        self.tmp = tmp
        (tmp / f"{name}.py").write_text(program)
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "w")
        launcher = subprocess.Popen([sys.executable, "-c", DETACH, str(tmp / f"{name}.py")], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=tmp,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        launcher.wait()  # it forked the keeper and left; the keeper holds the same pipes
        assert launcher.stdin is not None and launcher.stdout is not None
        self.stdin, self.stdout = launcher.stdin, launcher.stdout
        self._fd, self._pending = launcher.stdout.fileno(), b""
        first = self.line(30.0)
        self.pid = int(first.split()[1]) if first.startswith("PID ") else 0
        ready = self.line(start_timeout) if self.pid else first
        if not ready.startswith("READY"):
            self.shutdown()
            raise RuntimeError(f"{name} did not start: {ready!r}; see {self.log_path}")
        self.ready = ready.split(" ", 1)[1] if " " in ready else ""

    def line(self, timeout: float) -> str:
        """The keeper's next line, waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(left, 0))
            if not ready:
                return f"<nothing within {timeout:.0f} s>"
            chunk = os.read(self._fd, 65536)
            if not chunk:
                return "<the keeper ended>"
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def send(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Close its stdin (it stops its framework), wait for it; kill its whole session if it does not go."""
        try:
            self.stdin.close()
        except OSError:
            pass
        if self.pid:
            wait_until(lambda: not _alive(self.pid), timeout=timeout, step=0.2)
            try:
                os.killpg(self.pid, signal.SIGKILL)  # whatever of the framework is left: it is all in this session
            except (ProcessLookupError, PermissionError):
                pass
        self.stdout.close()
        self.log.close()


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and _state(pid) != "Z"


RAY_KEEPER = r'''
import os, shutil, sys, tempfile
print("PID", os.getpid(), flush=True)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no reports to the network (there is none in CI)
from ray.cluster_utils import Cluster
tmp = tempfile.mkdtemp(prefix="hora-ray-")  # short: Ray's socket paths must fit in 107 bytes
# Ray writes the cluster's address into its default temp folder (RAY_TMPDIR/ray) whatever temp_dir says, and
# fails if that folder is missing (a fresh machine has no /tmp/ray): keep that file in this cluster's folder too
os.environ["RAY_TMPDIR"] = tmp
os.makedirs(os.path.join(tmp, "ray"))
store = 256 * 1024 * 1024  # each node's object store (Ray's default is 30% of the machine's memory)
cluster = None
try:
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False, "temp_dir": tmp,
                                      "object_store_memory": store})
    cluster.add_node(num_cpus=2, object_store_memory=store)  # a second raylet: a second host
    cluster.wait_for_nodes()
    print("READY", cluster.address, flush=True)
    sys.stdin.read()  # until the session ends
finally:
    if cluster is not None:
        cluster.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
'''


class RayCluster:
    """A head node and a second node, started with the session and stopped at its end."""

    def __init__(self, tmp: Path) -> None:
        self.keeper = Keeper(RAY_KEEPER, tmp, "ray-keeper", start_timeout=180.0)
        self.address = self.keeper.ready

    def shutdown(self) -> None:
        self.keeper.shutdown()


SPARK_KEEPER = r'''
import json, os, runpy, sys, traceback
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # everything else printed (ours, the JVM's) goes to the log, not the request channel
sys.stdout = sys.stderr
print("PID", os.getpid(), file=proto)
os.environ["PYSPARK_PYTHON"] = sys.executable
import secrets
secret = os.path.abspath("hora.secret")  # the job's secret as docs/frameworks.md says to give it to TorchDistributor
with open(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
    f.write(secrets.token_hex(32))
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("hora-tests")
         .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
         .config("spark.executorEnv.HORA_SECRET_FILE", secret).getOrCreate())
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
spark.stop()
'''


class SparkDriver:
    """A driver with a SparkContext on local-cluster[2,1,1024] that runs the scripts tests send it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.keeper = Keeper(SPARK_KEEPER, tmp, "spark-driver", start_timeout=240.0)
        self.runs = 0

    def run(self, script: str, timeout: float = 180.0) -> dict[str, Any]:
        """Run ``TRAINING + script`` in the driver (globals ``spark``, ``sc``); its reply ``{"ok", "error"}``."""
        self.runs += 1
        path = self.tmp / f"job{self.runs}.py"
        path.write_text(TRAINING.replace('if __name__ == "__main__":', "if False:") + "\n" + script)
        self.keeper.send(json.dumps({"script": str(path)}))
        line = self.keeper.line(timeout)
        if not line.startswith("{"):
            raise AssertionError(f"the Spark driver gave no answer ({line}); its log: {self.keeper.log_path}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def shutdown(self) -> None:
        self.keeper.shutdown()


def java_missing() -> bool:
    return shutil.which("java") is None
