"""docker/compose.yaml (issue 14, item 2): the local 2-node cluster in one command, run with podman-compose."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import podman as pm
import pytest

pytestmark = pytest.mark.containers

COMPOSE = str(Path(__file__).resolve().parents[2] / "docker" / "compose.yaml")
JOB = ("import hora, torch; hora.init(); "
       "print('sum', hora.allreduce(torch.ones(1), op=hora.Sum).item(), hora.cross_size())")


def test_compose_cluster_runs_a_two_node_job(image: str) -> None:
    if shutil.which("podman-compose") is None:
        pytest.skip("podman-compose is not installed: run `make system-deps` as root")
    project = f"{pm.PREFIX}-compose"
    base = ["podman-compose", "--podman-args", " ".join(pm.PODMAN[1:]), "-p", project, "-f", COMPOSE]
    env = {**os.environ, "HORA_IMAGE": image}
    try:
        up = subprocess.run([*base, "--podman-run-args", " ".join(pm.LIMITS), "up", "-d", "--no-build"],
                            env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        node1 = pm.Container(f"{project}_node1_1")
        for node in (node1, pm.Container(f"{project}_node2_1")):
            node.wait_for_log("Server listening")
        out = node1.exec(["hora", "run", "-np", "2", "-H", "node1:1,node2:1", "-p", "2222", "python", "-c", JOB],
                         timeout=300, check=True)
        assert out.stdout.count("sum 2.0 2") == 2, out.stdout
    finally:
        for service in ("keys", "node1", "node2"):  # with their anonymous volumes, which `down -v` leaves
            pm.Container(f"{project}_{service}_1").remove()
        subprocess.run([*base, "down", "-v"], env=env, capture_output=True, timeout=300)
        pm.podman("network", "rm", "-f", f"{project}_hora", check=False)  # podman-compose 1.0.3 leaves it
