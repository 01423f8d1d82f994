"""The horovod.* modules Horovod's own Ray and Spark tests (and users) import, under hora's stand-in: the names
exist and do what Horovod's do."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

STAND_IN = Path(__file__).resolve().parents[2] / "src" / "hora" / "_compat"


@pytest.fixture
def horovod() -> Iterator[None]:
    sys.path.insert(0, str(STAND_IN))
    saved = {k: v for k, v in sys.modules.items() if k == "horovod" or k.startswith("horovod.")}
    try:
        yield
    finally:
        sys.path.remove(str(STAND_IN))
        for k in [k for k in sys.modules if k == "horovod" or k.startswith("horovod.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_common_util(horovod: None) -> None:
    util = importlib.import_module("horovod.common.util")
    assert util.gloo_built() is True and util.gloo_built(verbose=True) is True
    assert util.mpi_built() is False and isinstance(util.nccl_built(), int)
    assert [util.num_rank_is_power_2(n) for n in (1, 2, 3, 4, 6, 8)] == [True, True, False, True, False, True]
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert util.is_iterable([1]) and not util.is_iterable(3)
    os.environ.pop("HORA_TEST_ENV", None)
    with util.env(HORA_TEST_ENV="1"):
        assert os.environ["HORA_TEST_ENV"] == "1"
    assert "HORA_TEST_ENV" not in os.environ


def test_discovery_classes(horovod: None, tmp_path: Path) -> None:
    discovery = importlib.import_module("horovod.runner.elastic.discovery")
    fixed = discovery.FixedHosts({"a": 2})
    assert fixed.find_available_hosts_and_slots() == {"a": 2}
    fixed.set({"b": 1})
    assert fixed.find_available_hosts_and_slots() == {"b": 1}
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho host-1:2\necho host-2\n")
    script.chmod(0o755)
    assert discovery.HostDiscoveryScript(str(script), 3).find_available_hosts_and_slots() == {"host-1": 2,
                                                                                             "host-2": 3}
    with pytest.raises(NotImplementedError):
        discovery.HostDiscovery().find_available_hosts_and_slots()


def test_the_elastic_driver_module_is_hora_s_and_its_discovery_period_can_be_set(horovod: None) -> None:
    from hora.launcher.elastic import driver

    assert importlib.import_module("horovod.runner.elastic.driver") is driver
    with mock.patch("horovod.runner.elastic.driver.DISCOVER_HOSTS_FREQUENCY_SECS", 0.1):
        assert driver.DISCOVER_HOSTS_FREQUENCY_SECS == 0.1
    assert driver.DISCOVER_HOSTS_FREQUENCY_SECS == 1.0
    network = importlib.import_module("horovod.runner.util.network")
    assert network.get_driver_ip(["lo"]) == "127.0.0.1"


def test_spark_host_hash(horovod: None, monkeypatch: pytest.MonkeyPatch) -> None:
    util = importlib.import_module("horovod.spark.common.util")
    plain = util.host_hash()
    assert util.host_hash() == plain and util.host_hash("salt") != plain
    monkeypatch.setenv("CONTAINER_ID", "c1")
    assert util.host_hash() not in (plain, util.host_hash("salt"))


def test_ray_modules_name_what_horovods_tests_import(horovod: None) -> None:
    pytest.importorskip("ray")
    runner = importlib.import_module("horovod.ray.runner")
    coord = runner.Coordinator(runner.MiniSettings())
    for rank, node in enumerate(["n1", "n2", "n1", "n3"]):
        coord.register(f"host-{node}", node_id=node, world_rank=rank)
    assert coord.node_id_string == "n1:2,n2:1,n3:1" and coord.world_size == 4
    info = coord.finalize_registration()
    assert [(info[r]["HOROVOD_LOCAL_RANK"], info[r]["HOROVOD_CROSS_RANK"], info[r]["HOROVOD_CROSS_SIZE"])
            for r in range(4)] == [(0, 0, 3), (0, 1, 3), (1, 0, 1), (0, 2, 3)]
    assert importlib.import_module("horovod.ray.strategy").create_placement_group.__name__ == "create_placement_group"
    assert importlib.import_module("horovod.ray.worker").BaseHorovodWorker is runner.BaseHorovodWorker
    ray_logger = importlib.import_module("horovod.ray.ray_logger")
    with pytest.warns(UserWarning, match="outside an elastic Ray job"):
        ray_logger.log({"x": 1})
    assert importlib.import_module("horovod.ray.elastic_v2").RayHostDiscovery(cpus_per_worker=2).cpus_per_worker == 2
    assert importlib.import_module("horovod.ray.elastic").RayHostDiscovery(cpus_per_slot=3).cpus_per_worker == 3
