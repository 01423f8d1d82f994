"""hora on a real two-node Ray cluster: Ray Train's TorchTrainer running a hora script unchanged, and
hora.ray.RayExecutor (Horovod's horovod.ray API); a rank that raises or is killed ends the job at once."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from tests.frameworks.frameworks import RayCluster, gone, rank_files, run_driver
from tests.frameworks.training import reference

pytestmark = pytest.mark.frameworks


def _same_params(results: list[dict]) -> None:
    expected = reference()
    for r in results:
        assert r["params"] == pytest.approx(expected, rel=1e-5, abs=1e-6), f"rank {r['rank']} differs"


def test_torch_trainer_runs_a_hora_script_unchanged(ray_cluster: RayCluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    secret = tmp_path / "hora.secret"  # the job's secret as docs/frameworks.md says to give it under Ray Train
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    done = run_driver(f"""
import json, os, ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

def loop():
    result = train()
    ctx = ray.train.get_context()
    result["ray"] = [ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank(), ctx.get_local_world_size()]
    result["secret_file"] = os.environ.get("HORA_SECRET_FILE")
    with open(f"{out}/rank{{result['rank']}}.json", "w") as f:
        json.dump(result, f)

ray.init(address="{ray_cluster.address}", runtime_env={{"env_vars": {{"HORA_SECRET_FILE": "{secret}"}}}})
TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(storage_path="{tmp_path}/ray-results")).fit()
""", tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = rank_files(out, 2)
    for rank, r in enumerate(results):
        assert r["ray"][:2] == [rank, 2] and [r["rank"], r["size"]] == r["ray"][:2]
        assert r["secret_file"] == str(secret)
    # hora counts local ranks by machine: both workers run on this one, whichever Ray node took them
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2)]
    if all(r["ray"][3] == 2 for r in results):  # Ray put both on one node: its local ranks are hora's
        assert [r["ray"][2] for r in results] == [0, 1]
    _same_params(results)


EXECUTOR = """
import json, os, signal, sys, threading, time, ray
import hora
sys.path.append(os.path.join(os.path.dirname(hora.__file__), "_compat"))
from horovod.ray import RayExecutor  # the stand-in: hora.ray.RayExecutor

ray.init(address="{address}")
settings = RayExecutor.create_settings(timeout_s=120)
executor = RayExecutor(settings, num_hosts=2, num_workers_per_host=1, cpus_per_worker=1)
"""


def test_ray_executor_trains_across_two_nodes_with_horovods_api(ray_cluster: RayCluster, tmp_path: Path) -> None:
    done = run_driver(EXECUTOR.format(address=ray_cluster.address) + """
class Counter:
    def __init__(self, start):
        self.n = start
    def bump(self):
        self.n += 1
        return self.n

executor.start(executable_cls=Counter, executable_args=[10])
report = {"run": executor.run(train),
          "args": executor.run(lambda a, b=0: a + b, args=[1], kwargs={"b": 2}),
          "execute": executor.execute(lambda counter: counter.bump()),
          "single": executor.execute_single(lambda counter: counter.bump()),
          "remote": ray.get(executor.run_remote(lambda: __import__("hora").rank())),
          "horovod": executor.run(lambda: __import__("horovod.torch").torch.size())}
executor.shutdown()
print("REPORT " + json.dumps(report))
""", tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    results = report["run"]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["local_rank"] == 0 and r["local_size"] == 1 and r["cross_size"] == 2
               for r in results), "one rank per Ray node: two hosts"
    _same_params(results)
    assert report["args"] == [3, 3]
    assert report["execute"] == [11, 11] and report["single"] == 12
    assert report["remote"] == [0, 1]
    assert report["horovod"] == [2, 2]


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_failed_rank_ends_a_ray_executor_job(ray_cluster: RayCluster, tmp_path: Path, fault: str) -> None:
    done = run_driver(EXECUTOR.format(address=ray_cluster.address) + f"""
executor.start()
pids = executor.run(lambda: os.getpid())

def work(fault):
    import torch
    import hora as hvd
    hvd.init()
    if hvd.rank() == 1 and fault == "raise":
        raise ValueError("bad batch on rank 1")
    while True:  # rank 1 is killed from outside meanwhile
        hvd.allreduce(torch.ones(4))
        time.sleep(0.05)

if "{fault}" == "kill":
    threading.Timer(3.0, os.kill, (pids[1], signal.SIGKILL)).start()
began = time.monotonic()
try:
    executor.run(work, args=["{fault}"])
    error = None
except BaseException as e:
    error = e
print("REPORT " + json.dumps({{"pids": pids, "type": type(error).__name__, "message": str(error),
                               "cause": str(error.__cause__), "seconds": time.monotonic() - began}}))
""", tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    print(f"{fault}: run() raised {report['type']} {report['seconds']:.1f} s after it began")
    if fault == "raise":
        assert report["type"] == "ValueError" and report["message"] == "bad batch on rank 1"
        assert report["cause"].startswith("rank 1 on node ")
    else:
        assert report["type"] == "JobFailedError"
        assert report["message"].startswith("hora.ray: rank 1 on node "), report["message"]
        assert "\n" not in report["message"]
    headline = [line for line in done.stderr.splitlines() if line.startswith("hora.ray: rank 1 on node ")]
    assert headline, done.stderr[-3000:]
    assert gone(report["pids"], within=20) == [], "the rank actors' processes are still running"


def test_a_killed_torch_trainer_worker_ends_the_run(ray_cluster: RayCluster, tmp_path: Path) -> None:
    done = run_driver(f"""
import json, os, signal, threading, time, ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

def loop():
    import torch
    import hora as hvd
    hvd.init()
    with open(f"{tmp_path}/pid{{hvd.rank()}}", "w") as f:
        f.write(str(os.getpid()))
    while True:
        hvd.allreduce(torch.ones(4))
        time.sleep(0.05)

killed = []

def kill_rank_1():
    while not os.path.exists("{tmp_path}/pid1"):
        time.sleep(0.1)
    time.sleep(1.0)
    os.kill(int(open("{tmp_path}/pid1").read()), signal.SIGKILL)
    killed.append(time.monotonic())

ray.init(address="{ray_cluster.address}")
threading.Thread(target=kill_rank_1, daemon=True).start()
began = time.monotonic()
try:
    TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path="{tmp_path}/ray-results")).fit()
    error = None
except BaseException as e:
    error = e
print("REPORT " + json.dumps({{"type": type(error).__name__, "message": str(error),
                               "seconds": time.monotonic() - killed[0]}}))
""", tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    print(f"fit() raised {report['type']} {report['seconds']:.1f} s after the kill")
    # Ray Train's report: each rank's error; hora's line on rank 0 names the rank that went and its host
    assert report["type"] == "WorkerGroupError", report
    assert "rank 0: rank 1 on host " in report["message"] and "is gone" in report["message"], report["message"]
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert gone(pids, within=20) == [], "Ray Train's worker processes are still running"


def test_a_placement_the_cluster_cannot_satisfy_is_a_timeout_error(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """As Horovod's test_infeasible_placement: start() raises TimeoutError (hora's message, a ConfigError too)."""
    done = run_driver(f"""
import sys, os, ray, hora
sys.path.append(os.path.join(os.path.dirname(hora.__file__), "_compat"))
from horovod.ray import RayExecutor
from hora.errors import ConfigError
ray.init(address="{ray_cluster.address}")
executor = RayExecutor(RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=5), num_hosts=3,
                       num_workers_per_host=1)
try:
    executor.start()
except TimeoutError as e:
    assert isinstance(e, ConfigError), type(e)
    print("RAISED " + str(e))
executor.shutdown()
""", tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAISED hora.ray: the cluster could not place 3 ranks" in done.stdout
    assert "on 3 different nodes within 5 s" in done.stdout
