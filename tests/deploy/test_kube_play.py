"""The pods the operators would create from deploy/k8s, run for real with ``podman kube play`` (issue 14, item 3).

No Kubernetes cluster runs here, so this does the operators' part by hand, from the manifests' own pod
templates: for the MPIJob, worker pods running sshd with the SSH keys mounted at ``sshAuthMountPath`` and a
launcher pod with ``/etc/mpi/hostfile`` (``<worker pod> slots=N``, as mpi-operator writes it); for the
PyTorchJob, a master and a worker pod with the variables the training-operator sets (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, PET_*). Both train train_digits.py across the two pods.

Where podman differs from a cluster: the keys and hostfile come from host directories (podman 4.3 crashes on
secret volumes), containerPort is dropped (podman publishes it on the host), pods find each other by pod name
on the podman network (instead of the operators' headless services), a memory emptyDir is a plain volume, and
the PVCs are podman named volumes.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import podman as pm
from tests.deploy.podman import make_keys

pytestmark = pytest.mark.containers

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


@pytest.fixture
def play(image: str, tmp_path: Path) -> Iterator[tuple[Path, str, dict[str, str]]]:
    """A network, the PVCs as named volumes, a containers.conf with this machine's settings; removed after."""
    conf = tmp_path / "containers.conf"
    limits = ", ".join(f'"{pm.LIMITS[i + 1]}"' for i in range(0, len(pm.LIMITS), 2))
    conf.write_text(f'[containers]\ndefault_ulimits = [{limits}]\n[engine]\nruntime = "runc"\n')
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    network = f"{pm.PREFIX}-kube"
    pm.podman("network", "create", network)
    for claim in ("hora-data", "hora-checkpoints"):
        pm.podman("volume", "create", f"{pm.PREFIX}-{claim}")
    try:
        yield tmp_path, network, env
    finally:
        for line in pm.podman("pod", "ls", "--format", "{{.Name}}", check=False).stdout.split():
            if line.startswith(f"{pm.PREFIX}-"):
                members = pm.podman("ps", "-a", "-q", "--filter", f"pod={line}", check=False).stdout.split()
                if members:  # with their anonymous volumes
                    pm.podman("rm", "-f", "-v", "-t", "0", *members, check=False)
                pm.podman("pod", "rm", "-f", "-t", "0", line, check=False)
        for claim in ("hora-data", "hora-checkpoints"):
            pm.podman("volume", "rm", "-f", f"{pm.PREFIX}-{claim}", check=False)
        pm.podman("network", "rm", "-f", network, check=False)


def _manifest(name: str) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all((K8S / name).read_text()) if d)


def _pod(name: str, template: dict[str, Any], image: str, extra_mounts: dict[str, str],
         secrets: dict[str, str] | None = None) -> dict[str, Any]:
    """A Pod from a replica's template, as an operator makes it (the image and PVC names made local; a Secret
    volume becomes the host directory ``secrets[secretName]`` holding its files: podman 4.3 crashes on secret
    volumes)."""
    spec = copy.deepcopy(template["spec"])
    spec["hostname"] = name
    spec["restartPolicy"] = "Never"
    container = spec["containers"][0]
    container["image"] = image
    container.pop("ports", None)  # podman 4.3 publishes a containerPort on the host: two workers would clash
    container["args"] = ["1" if a == "5" and container["args"][i - 1] == "--epochs" else a
                         for i, a in enumerate(container["args"])]  # one epoch is enough here
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            volume["hostPath"] = {"path": (secrets or {})[volume.pop("secret")["secretName"]], "type": "Directory"}
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] = f"{pm.PREFIX}-{volume['persistentVolumeClaim']['claimName']}"
    for i, (path, host_dir) in enumerate(extra_mounts.items()):
        spec.setdefault("volumes", []).append({"name": f"op{i}", "hostPath": {"path": host_dir, "type": "Directory"}})
        container.setdefault("volumeMounts", []).append({"name": f"op{i}", "mountPath": path})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _play(pod: dict[str, Any], where: Path, network: str, env: dict[str, str]) -> str:
    path = where / f"{pod['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(pod))
    out = subprocess.run(["podman", "kube", "play", "--network", network, str(path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return f"{pod['metadata']['name']}-{pod['spec']['containers'][0]['name']}"


def _wait(container: str, timeout: float = 600) -> tuple[int, str]:
    code = pm.podman("wait", container, timeout=timeout).stdout.strip()
    return int(code), pm.Container(container).logs()


def test_mpijob_launcher_and_workers_train(play: tuple[Path, str, dict[str, str]], image: str) -> None:
    tmp, network, env = play
    job = _manifest("mpijob.yaml")
    spec = job["spec"]
    name = f"{pm.PREFIX}-{job['metadata']['name']}"
    keys = str(make_keys(tmp / "ssh"))  # the operator's <job>-ssh secret
    workers = [f"{name}-worker-{i}" for i in range(spec["mpiReplicaSpecs"]["Worker"]["replicas"])]
    (tmp / "mpi").mkdir()
    (tmp / "mpi" / "hostfile").write_text("".join(f"{w} slots={spec['slotsPerWorker']}\n" for w in workers))
    mounts = {spec["sshAuthMountPath"]: keys}
    worker_containers = [_play(_pod(w, spec["mpiReplicaSpecs"]["Worker"]["template"], image, mounts), tmp, network,
                               env) for w in workers]
    for c in worker_containers:
        pm.Container(c).wait_for_log("Server listening")
    launcher = _pod(f"{name}-launcher", spec["mpiReplicaSpecs"]["Launcher"]["template"], image,
                    {**mounts, "/etc/mpi": str(tmp / "mpi")})
    code, logs = _wait(_play(launcher, tmp, network, env))
    assert code == 0, logs[-3000:]
    assert re.search(r"ranks: 2 .*test accuracy \(averaged over ranks\): 0\.[5-9]", logs), logs[-3000:]


def test_pytorchjob_master_and_worker_train(play: tuple[Path, str, dict[str, str]], image: str) -> None:
    tmp, network, env = play
    job = _manifest("pytorchjob.yaml")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    name = f"{pm.PREFIX}-{job['metadata']['name']}"
    master = f"{name}-master-0"
    world = sum(r["replicas"] for r in replicas.values())
    # the Secret the manifest's comment says to make (`hora secret - | kubectl create secret ...`), as a directory
    made = subprocess.run([str(Path(sys.executable).parent / "hora"), "secret", "-"], capture_output=True, text=True,
                          check=True)
    (tmp / "secret").mkdir()
    (tmp / "secret" / "secret").write_text(made.stdout)
    (tmp / "secret" / "secret").chmod(0o444)  # the pod's user reads it (a Secret's defaultMode applies on a cluster)
    containers = []
    for rank, (role, index) in enumerate([("Master", 0), ("Worker", 0)]):
        pod = _pod(f"{name}-{role.lower()}-{index}", replicas[role]["template"], image, {},
                   {"hora-digits-ptj-secret": str(tmp / "secret")})
        # What the training-operator sets in each pod (one process per pod: PET_NPROC_PER_NODE=1).
        pod["spec"]["containers"][0]["env"] += [{"name": k, "value": str(v)} for k, v in {
            "MASTER_ADDR": master, "MASTER_PORT": 23456, "WORLD_SIZE": world, "RANK": rank,
            "PET_MASTER_ADDR": master, "PET_MASTER_PORT": 23456, "PET_NNODES": world, "PET_NODE_RANK": rank,
            "PET_NPROC_PER_NODE": 1, "PYTHONUNBUFFERED": 1}.items()]
        containers.append(_play(pod, tmp, network, env))
    results = [_wait(c) for c in containers]
    for code, logs in results:
        assert code == 0, logs[-3000:]
    master_logs = results[0][1]
    assert re.search(r"ranks: 2 .*test accuracy \(averaged over ranks\): 0\.[5-9]", master_logs), master_logs[-3000:]
    assert "no job secret" not in master_logs  # HORA_SECRET_FILE from the mounted Secret: authenticated
