"""Session fixtures: a Ray cluster and a Spark driver on a local-cluster, each started once (see frameworks.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.frameworks.frameworks import RayCluster, SparkDriver, java_missing, module_missing, require


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    require("ray", module_missing("ray"), "pip install 'hora[ray]', or make .venv from requirements-dev.txt")
    cluster = RayCluster(Path(tmp_path_factory.mktemp("ray-cluster")))
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def spark_driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkDriver]:
    require("pyspark", module_missing("pyspark"), "pip install 'hora[spark]', or make .venv from requirements-dev.txt")
    require("java", java_missing(), "apt-get install openjdk-17-jre-headless, or `make system-deps` as root")
    driver = SparkDriver(Path(tmp_path_factory.mktemp("spark-driver")))
    try:
        yield driver
    finally:
        driver.shutdown()
