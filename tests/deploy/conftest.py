"""Fixtures for the deployment tests: the CPU image (built once per session) and a 2-container cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy import podman as pm
from tests.deploy.podman import Pair, make_keys


@pytest.fixture(scope="session")
def image() -> str:
    reason = pm.missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    pm.clean_stale()
    return pm.ensure_image()


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
