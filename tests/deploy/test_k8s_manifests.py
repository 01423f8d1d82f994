"""deploy/k8s validated offline (issue 14, item 3): no cluster runs here, so every manifest is checked against
the API's own schemas. Built-in kinds go through kubernetes-validate (strict: unknown fields rejected), the
operators' kinds through check-jsonschema with the CRDs' schemas (tests/deploy/schemas, strict variants; see
SOURCES.txt there). What JSON Schema cannot say (the operators' webhook rules) is checked here by hand.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("kubeflow.org/v2beta1", "MPIJob"): "mpijob-kubeflow.org-v2beta1-strict.json",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-kubeflow.org-v1-strict.json",
    ("batch.volcano.sh/v1alpha1", "Job"): "job-batch.volcano.sh-v1alpha1-strict.json",
}


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: pip install -r requirements-dev.txt")
    return found


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _validate(doc: dict[str, Any], tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        argv = [_tool("check-jsonschema"), "--schemafile", str(SCHEMAS / schema), str(path)]
    else:
        argv = [_tool("kubernetes-validate"), "--strict", "--quiet", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_every_manifest_passes_its_schema(tmp_path: Path) -> None:
    docs = _documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"MPIJob", "PyTorchJob", "Job", "Deployment", "PersistentVolumeClaim", "Service"} <= kinds
    for i, (source, doc) in enumerate(docs):
        out = _validate(doc, tmp_path, f"{i}.yaml")
        assert out.returncode == 0, f"{source} {doc['kind']}/{doc['metadata']['name']}:\n{out.stdout}{out.stderr}"


def _by_kind(kind: str) -> dict[str, Any]:
    return next(d for _, d in _documents() if d["kind"] == kind)


@pytest.mark.parametrize("kind,break_it", [
    ("MPIJob", lambda d: d["spec"]["mpiReplicaSpecs"]["Worker"].update(replica=2)),  # misspelled replicas
    ("PyTorchJob", lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
     .update(volumeMount=[])),
    ("Job", lambda d: d["spec"]["tasks"][1]["template"]["spec"]["volumes"][2]["emptyDir"].update(medium=7)),
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=["Always"])),
    ("Deployment", lambda d: d["spec"]["template"]["spec"].update(volume=[])),  # unknown field, strict mode
])
def test_a_broken_manifest_is_rejected(kind: str, break_it: Any, tmp_path: Path) -> None:
    doc = _by_kind(kind)
    break_it(doc)
    out = _validate(doc, tmp_path, "broken.yaml")
    assert out.returncode != 0, out.stdout + out.stderr


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "MPIJob":
        return [r["template"]["spec"] for r in doc["spec"]["mpiReplicaSpecs"].values()]
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    if doc["kind"] == "Job":
        return [t["template"]["spec"] for t in doc["spec"]["tasks"]]
    return [doc["spec"]["template"]["spec"]]


def test_rules_the_schemas_cannot_express() -> None:
    ptj = _by_kind("PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    assert ptj["Master"]["replicas"] == 1  # the operator's webhook: exactly one Master
    assert all(r["template"]["spec"]["containers"][0]["name"] == "pytorch" for r in ptj.values())
    mpi = _by_kind("MPIJob")["spec"]
    launcher = mpi["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["args"][:3] == ["run", "--hostfile", "/etc/mpi/hostfile"]
    assert mpi["sshAuthMountPath"] == "/etc/hora/ssh"  # where the entrypoint takes keys from
    vc = _by_kind("Job")["spec"]
    assert set(vc["plugins"]) >= {"ssh", "svc"}
    # The job's secret (docs/security.md): the PyTorchJob's pods read it from a mounted Secret, read-only, mode
    # 0400; the MPIJob's and the Volcano Job's launchers run `hora run`, which makes one of its own.
    for role in ptj.values():
        spec = role["template"]["spec"]
        container = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "job-secret")
        assert env["HORA_SECRET_FILE"].startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
        assert env["HORA_REQUIRE_SECRET"] == "1"
        volume = next(v for v in spec["volumes"] if v["name"] == "job-secret")
        assert volume["secret"] == {"secretName": "hora-digits-ptj-secret", "defaultMode": 0o400}
    assert vc["tasks"][0]["template"]["spec"]["containers"][0]["args"][0] == "run"
    # Every pod that trains has the shared volumes and a memory-backed /dev/shm.
    for _, doc in _documents():
        if doc["kind"] not in ("MPIJob", "PyTorchJob", "Job", "Deployment"):
            continue
        for spec in _pod_specs(doc):
            mounts = {m["mountPath"] for m in spec["containers"][0].get("volumeMounts", [])}
            if spec["containers"][0]["args"][0] in ("run",):  # a launcher does not train
                continue
            assert {"/data", "/checkpoints", "/dev/shm"} <= mounts, doc["kind"]
            shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory"
            claims = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
            assert claims == {"hora-data", "hora-checkpoints"}
