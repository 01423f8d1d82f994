"""Fixtures for the deployment tests: the CPU image (built once per session) and a 2-container cluster."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import podman as pm


@pytest.fixture(scope="session")
def image() -> str:
    reason = pm.missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    pm.clean_stale()
    return pm.ensure_image()


@dataclass
class Pair:
    """Two containers running sshd on one user network, sharing a host directory as /data."""

    network: str
    nodes: list[pm.Container]
    data: Path
    keys: Path


def make_keys(where: Path) -> Path:
    """An SSH key pair and authorized_keys as a mounted secret would give them (loose permissions on purpose)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(where / "id_ed25519")], check=True)
    (where / "authorized_keys").write_text((where / "id_ed25519.pub").read_text())
    for f in where.iterdir():
        f.chmod(0o666 if f.name == "authorized_keys" else 0o644)  # the entrypoint must fix these
    return where


@pytest.fixture(scope="session")
def pair(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("pair")
    keys = make_keys(tmp / "keys")
    data = tmp / "data"
    data.mkdir()
    data.chmod(0o777)  # shared storage the non-root user in the image writes to
    network = f"{pm.PREFIX}-net"
    pm.podman("network", "create", network)
    nodes: list[pm.Container] = []
    try:
        for name in ("node1", "node2"):
            nodes.append(pm.run_container(name, image, ["sshd"], network=network,
                                          volumes=[f"{keys}:/etc/hora/ssh:ro", f"{data}:/data"]))
        for node in nodes:
            node.wait_for_log("Server listening")
        yield Pair(network, nodes, data, keys)
    finally:
        for node in nodes:
            node.remove()
        pm.podman("network", "rm", "-f", network, check=False)
