"""docker/compose.yaml: the local 2-node cluster as docs/deploy.md's quick start runs it, with podman-compose.

podman-compose exits 0 even when no container could start, so the quick start checks with
docker/cluster-check.sh, which must see containers stuck in "Created" and say how to start them (the ulimits),
then pass on a cluster that is really up. The documented teardown (``down -v``, then the network podman-compose
leaves) must leave nothing of the project behind: no container, volume (named or anonymous) or network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy import podman as pm

pytestmark = pytest.mark.containers

COMPOSE = str(Path(__file__).resolve().parents[2] / "docker" / "compose.yaml")
CHECK = str(Path(__file__).resolve().parents[2] / "docker" / "cluster-check.sh")
JOB = ("import hora, torch; hora.init(); "
       "print('sum', hora.allreduce(torch.ones(1), op=hora.Sum).item(), hora.cross_size())")


def _left(project: str) -> dict[str, list[str]]:
    """Containers, volumes and networks carrying the project's compose label."""
    label = f"label=com.docker.compose.project={project}"
    return {kind: pm.podman(*cmd, "--filter", label, "--format", "{{.Name}}" if kind != "containers"
                            else "{{.Names}}", check=False).stdout.split()
            for kind, cmd in (("containers", ("ps", "-a")), ("volumes", ("volume", "ls")),
                              ("networks", ("network", "ls")))}


def test_compose_cluster_is_checked_runs_a_two_node_job_and_is_removed_completely(image: str) -> None:
    if shutil.which("podman-compose") is None:
        pytest.skip("podman-compose is not installed: run `make system-deps` as root")
    project = f"{pm.PREFIX}-compose"
    base = ["podman-compose", "--podman-args", " ".join(pm.PODMAN[1:]), "-p", project, "-f", COMPOSE]
    env = {**os.environ, "HORA_IMAGE": image, "CONTAINER": "podman", "WAIT": "90"}

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)

    try:
        # As a user runs it first: podman's default limits, which podman as root cannot set here.
        up = run(*base, "up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]  # podman-compose says nothing is wrong
        check = run(CHECK, "-p", project)
        if check.returncode == 0:
            pytest.skip("podman may set its default limits on this machine: the containers started")
        assert "node1 (" in check.stderr and "is 'created': it was made but could not start" in check.stderr
        assert "--ulimit nofile=" in check.stderr and "podman-compose -f docker/compose.yaml down -v" in check.stderr
        run(*base, "down", "-v")

        up = run(*base, "--podman-run-args", " ".join(pm.LIMITS), "up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        check = run(CHECK, "-p", project, timeout=300)
        assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
        assert "cluster-check: the cluster is up" in check.stderr
        assert "OK: every host answered and versions agree" in check.stdout
        out = pm.Container(f"{project}_node1_1").exec(
            ["hora", "run", "-np", "2", "-H", "node1:1,node2:1", "-p", "2222", "python", "-c", JOB],
            timeout=300, check=True)
        assert out.stdout.count("sum 2.0 2") == 2, out.stdout

        containers = [f"{project}_{service}_1" for service in ("keys", "node1", "node2")]
        mounts = pm.podman("inspect", "--format", "{{range .Mounts}}{{.Name}} {{end}}", *containers)
        mounted = set(mounts.stdout.split())
        assert {f"{project}_{v}" for v in ("keys", "data", "checkpoints")} <= mounted
        down = run(*base, "down", "-v")
        assert down.returncode == 0, down.stderr[-2000:]
        pm.podman("network", "rm", f"{project}_hora")  # the documented second step: podman-compose leaves it
        assert _left(project) == {"containers": [], "volumes": [], "networks": []}
        left = [v for v in mounted if pm.podman("volume", "exists", v, check=False).returncode == 0]
        assert left == []  # named and anonymous: every volume a container of the project mounted
    finally:
        for service in ("keys", "node1", "node2"):  # whatever a failure above left
            pm.Container(f"{project}_{service}_1").remove()
        run(*base, "down", "-v")
        pm.podman("network", "rm", "-f", f"{project}_hora", check=False)
