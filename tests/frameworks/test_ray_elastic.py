"""Elastic hora jobs on a real Ray cluster (``RayExecutor(min_workers=...)``, ``ElasticRayExecutor``): a worker's
actor that dies mid-training leaves its peers to go on in place, from their last commit, in a smaller world; a
new actor joins when its slot comes back; below ``min_workers`` the job fails with one line naming the lost rank
and its node; no actor process is left either way.

The cluster (conftest's ``ray_cluster``) is two Ray nodes of 2 CPUs on this machine: one host of 4 slots to hora.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.frameworks import RayCluster, gone, run_driver

pytestmark = pytest.mark.frameworks

# The training: a fixed batch of 12 samples split into equal shards (3 or 2 ranks), mean loss, averaged gradients:
# every step applies the whole batch's gradient whatever the world's size, so the final parameters equal one
# process's over the same steps, provided each step is applied exactly once (the reset goes back to the last
# commit, made after every step). Rank 1 of the first world SIGKILLs its own actor process before step KILL_AT
# (raises, in the test where a newcomer joins).
ELASTIC = """
import json, os, signal, sys, time, ray
import hora
sys.path.append(os.path.join(os.path.dirname(hora.__file__), "_compat"))
from horovod.ray import ElasticRayExecutor, RayExecutor  # the stand-ins: hora.ray's

STEPS, KILL_AT = 8, 3

def data():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, generator=gen)
    return model, x, x.sum(dim=1, keepdim=True)

def elastic_train(out_dir):
    import torch
    import hora as hvd
    hvd.init()
    open(os.path.join(out_dir, f"pid-{os.getpid()}"), "w").close()
    model, x, y = data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=[])

    def done():
        if "@mode@" != "rejoin":
            return state.step >= STEPS
        back = [i for i in range(1, len(state.sizes)) if state.sizes[i - 1] == 2 and state.sizes[i] == 3]
        return state.step >= 3000 or (state.step >= STEPS and bool(back) and len(state.sizes) - back[0] >= 3)

    @hvd.elastic.run
    def loop(state):
        while not done():
            rank, size = hvd.rank(), hvd.size()
            if size == 3 and rank == 1 and state.step == KILL_AT:
                if "@mode@" == "rejoin":
                    raise ValueError("bad batch on rank 1")  # a worker that raises is a failed worker too
                os.kill(os.getpid(), signal.SIGKILL)  # this actor's process dies mid-training
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank::size]), y[rank::size]).backward()
            opt.step()
            state.step += 1
            state.sizes = state.sizes + [size]
            state.commit()
            if "@mode@" == "rejoin":
                time.sleep(0.05)  # a newcomer takes seconds to start: steps go on meanwhile

    loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "sizes": state.sizes, "pid": os.getpid(),
            "params": [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]}

def reference(steps):
    import torch
    model, x, y = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [v for p in model.parameters() for v in p.detach().reshape(-1).tolist()]

ray.init(address="@address@")
out = os.path.abspath("pids")
os.makedirs(out, exist_ok=True)
if "@api@" == "ElasticRayExecutor":  # Horovod's older API: settings hold the limits, worker_fn() takes nothing
    executor = ElasticRayExecutor(ElasticRayExecutor.create_settings(
        min_num_proc=@min_workers@, max_num_proc=3, elastic_timeout=@elastic_timeout@, timeout_s=120),
        cpus_per_slot=1)
    run = lambda: executor.run(lambda: elastic_train(out))
else:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), min_workers=@min_workers@, max_workers=3,
                           cpus_per_worker=1, elastic_timeout=@elastic_timeout@, cooldown_range=@cooldown@)
    run = lambda: executor.run(elastic_train, args=[out])
executor.start()
began = time.monotonic()
try:
    report = {"results": run()}
except BaseException as e:
    report = {"type": type(e).__name__, "message": str(e), "code": getattr(e, "exit_code", None),
               "cause": type(e.__cause__).__name__}
executor.shutdown()
report["seconds"] = time.monotonic() - began
report["reference"] = reference(len(report["results"][0]["sizes"]) if "results" in report else STEPS)
report["pids"] = [int(name.split("-")[1]) for name in os.listdir(out)]
print("REPORT " + json.dumps(report))
"""


def _run(ray_cluster: RayCluster, tmp_path: Path, *, min_workers: int, elastic_timeout: int, mode: str = "kill",
         cooldown: str = "None", started: int = 3, api: str = "RayExecutor") -> tuple[dict, str]:
    script = ELASTIC
    for name, value in (("address", ray_cluster.address), ("min_workers", str(min_workers)), ("mode", mode),
                        ("elastic_timeout", str(elastic_timeout)), ("cooldown", cooldown), ("api", api)):
        script = script.replace(f"@{name}@", value)
    done = run_driver(script, tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    assert len(report["pids"]) == started, f"{started} worker processes expected: {report}\n{done.stderr[-3000:]}"
    assert gone(report["pids"], within=30) == [], "an actor process is left running"
    return report, done.stderr


def test_survivors_of_a_killed_actor_go_on_and_finish(ray_cluster: RayCluster, tmp_path: Path) -> None:
    report, stderr = _run(ray_cluster, tmp_path, min_workers=2, elastic_timeout=60)
    assert "results" in report, f"the job failed: {report}\n{stderr[-3000:]}"
    results = report["results"]
    print(f"elastic run: {report['seconds']:.1f} s")
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    for r in results:  # three ranks until the kill, two after it; every step applied once
        assert r["sizes"] == [3, 3, 3, 2, 2, 2, 2, 2], r["sizes"]
    assert results[0]["params"] == results[1]["params"], "the survivors' parameters differ"
    assert results[0]["params"] == pytest.approx(report["reference"], rel=1e-5, abs=1e-6)
    assert "hora.ray: elastic: world 2: 2 workers" in stderr, stderr[-3000:]
    assert "rank 1) on host " in stderr and "failed: its Ray actor died" in stderr, stderr[-3000:]


def test_a_new_actor_joins_when_the_slot_comes_back(ray_cluster: RayCluster, tmp_path: Path) -> None:
    # rank 1 raises (its traceback shows on the driver's stderr) and the others go on; with a blacklist cooldown
    # the host takes workers again: a new actor starts on the freed CPU and joins
    report, stderr = _run(ray_cluster, tmp_path, min_workers=2, elastic_timeout=60, mode="rejoin",
                          cooldown="[1, 2]", started=4)
    assert "results" in report, f"the job failed: {report}\n{stderr[-3000:]}"
    results = report["results"]
    print(f"elastic run with a newcomer: {report['seconds']:.1f} s, {len(results[0]['sizes'])} steps")
    assert [r["rank"] for r in results] == [0, 1, 2] and all(r["size"] == 3 for r in results)
    sizes = results[0]["sizes"]
    assert sizes[:3] == [3, 3, 3] and sizes[3] == 2 and sizes[-1] == 3, sizes
    assert all(r["sizes"] == sizes for r in results), "the newcomer got the state of the others"
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
    assert results[0]["params"] == pytest.approx(report["reference"], rel=1e-4, abs=1e-5)
    assert "hora.ray: elastic: world 3: 3 workers" in stderr, stderr[-3000:]
    worker_lines = [text for text in stderr.splitlines() if text.startswith("[1]<stderr>:")]
    assert any(", in loop" in text for text in worker_lines), stderr[-3000:]
    assert worker_lines[-1] == "[1]<stderr>:ValueError: bad batch on rank 1", stderr[-3000:]


def test_below_min_workers_the_job_fails_naming_the_lost_rank(ray_cluster: RayCluster, tmp_path: Path) -> None:
    report, stderr = _run(ray_cluster, tmp_path, min_workers=3, elastic_timeout=5, api="ElasticRayExecutor")
    assert report.get("type") == "JobFailedError", report
    message = report["message"]
    assert "\n" not in message
    assert message.startswith("hora.ray: fewer than 3 slots (min_workers) for elastic_timeout 5s: 2 available"), \
        message
    assert "lost: rank 1 (worker " in message and "(Ray node " in message, message
    assert "its Ray actor died" in message, message
    assert report["code"] == 75 and report["cause"] == "ActorDiedError", report
    assert "hora.ray: job failed: fewer than 3 slots (min_workers)" in stderr, stderr[-3000:]
    assert "hora run:" not in stderr, "the driver's lines name the executor, not hora run"
