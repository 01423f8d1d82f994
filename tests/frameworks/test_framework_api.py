"""hora.ray and hora.spark against Horovod 0.28.1's horovod.ray / horovod.spark: the same names, parameters in
the same order with the same defaults; and the pure parts (where ranks go, which rank failed first), no cluster.

The signatures below are written down from Horovod 0.28.1's sources (horovod/ray/runner.py, horovod/ray/elastic.py,
horovod/spark/runner.py).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from tests.frameworks.frameworks import java_missing, module_missing, require

pytestmark = pytest.mark.frameworks
REQ = object()

RAY_EXECUTOR = {
    "__init__": [("settings", REQ), ("num_workers", None), ("num_hosts", None), ("num_workers_per_host", 1),
                 ("cpus_per_worker", 1), ("use_gpu", False), ("gpus_per_worker", None),
                 ("use_current_placement_group", True), ("min_workers", None), ("max_workers", None),
                 ("reset_limit", None), ("cooldown_range", None), ("elastic_timeout", 600),
                 ("override_discovery", True)],
    "create_settings": [("timeout_s", 30), ("ssh_identity_file", None), ("ssh_str", None),
                        ("placement_group_timeout_s", 100), ("nics", None)],
    "start": [("executable_cls", None), ("executable_args", None), ("executable_kwargs", None),
              ("extra_env_vars", None)],
    "execute": [("fn", REQ), ("callbacks", None)],
    "run": [("fn", REQ), ("args", None), ("kwargs", None), ("callbacks", None)],
    "run_remote": [("fn", REQ), ("args", None), ("kwargs", None)],
    "execute_single": [("fn", REQ)],
    "shutdown": [],
}
ELASTIC_RAY_EXECUTOR = {  # horovod/ray/elastic.py
    "__init__": [("settings", REQ), ("use_gpu", False), ("cpus_per_slot", 1), ("gpus_per_slot", None),
                 ("env_vars", None), ("override_discovery", True)],
    "create_settings": [("min_num_proc", 1), ("max_num_proc", None), ("reset_limit", None), ("elastic_timeout", 600),
                        ("timeout_s", 30), ("ssh_identity_file", None), ("nics", None), ("min_np", None),
                        ("max_np", None), ("kwargs", REQ)],
    "start": [],
    "run": [("worker_fn", REQ), ("callbacks", None)],
}
SPARK_RUN = [("fn", REQ), ("args", ()), ("kwargs", {}), ("num_proc", None), ("start_timeout", None),
             ("use_mpi", None), ("use_gloo", None), ("extra_mpi_args", None), ("env", None), ("stdout", None),
             ("stderr", None), ("verbose", 1), ("nics", None), ("prefix_output_with_timestamp", False),
             ("executable", None)]


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, REQ if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


def _same(fn: Any, expected: list[tuple[str, Any]]) -> None:
    got = _params(fn)
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, default), (_, want) in zip(got, expected):
        if want is REQ:
            assert default is REQ, name
        elif name == "kwargs" and want == {}:
            assert default in ({}, None), name  # a fresh dict each call instead of Horovod's shared one
        else:
            assert default == want, name


@pytest.fixture
def ray_module() -> Any:
    require("ray", module_missing("ray"), "pip install 'hora[ray]'")
    import hora.ray

    return hora.ray


@pytest.fixture
def spark_module() -> Any:
    require("pyspark", module_missing("pyspark"), "pip install 'hora[spark]'")
    import hora.spark

    return hora.spark


@pytest.mark.parametrize("method", sorted(RAY_EXECUTOR))
def test_ray_executor_has_horovods_signatures(ray_module: Any, method: str) -> None:
    _same(getattr(ray_module.RayExecutor, method), RAY_EXECUTOR[method])


@pytest.mark.parametrize("method", sorted(ELASTIC_RAY_EXECUTOR))
def test_elastic_ray_executor_has_horovods_signatures(ray_module: Any, method: str) -> None:
    _same(getattr(ray_module.ElasticRayExecutor, method), ELASTIC_RAY_EXECUTOR[method])


def test_spark_run_has_horovods_signature(spark_module: Any) -> None:
    _same(spark_module.run, SPARK_RUN)


def test_ray_ranks_get_their_place_by_ray_node(ray_module: Any) -> None:
    from hora.ray.placement import rank_environments, visible_devices

    nodes = ["aaaaaaaaaa", "bbbbbbbbbb", "aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"]
    ips = ["10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.3"]  # two Ray nodes on one machine: 2 hosts
    envs = rank_environments(nodes, ips, "10.0.0.1", 29511)
    assert [(e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"]) for e in envs] == [
        ("0", "2"), ("0", "2"), ("1", "2"), ("1", "2"), ("0", "1")]
    assert [(e["HOROVOD_CROSS_RANK"], e["HOROVOD_CROSS_SIZE"]) for e in envs] == [
        ("0", "3"), ("1", "3"), ("0", "2"), ("1", "2"), ("2", "3")]
    assert envs[1]["HOROVOD_HOSTNAME"] == "10.0.0.1/bbbbbbbb" != envs[0]["HOROVOD_HOSTNAME"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29511")}
    assert visible_devices(["a", "b", "a"], [[0], [0], [1]]) == ["0,1", "0", "0,1"]


def test_ray_executor_refuses_what_it_cannot_do(ray_module: Any) -> None:
    from hora.errors import ConfigError

    settings = ray_module.RayExecutor.create_settings()
    with pytest.raises(ValueError, match="max_workers is given without min_workers"):
        ray_module.RayExecutor(settings, max_workers=2)
    with pytest.raises(ValueError, match="not both"):
        ray_module.RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="less than min_workers"):
        ray_module.RayExecutor(settings, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="give min_workers too"):
        ray_module.RayExecutor(settings, num_workers=2, reset_limit=1)
    elastic = ray_module.RayExecutor(settings, min_workers=1, max_workers=2)
    with pytest.raises(ConfigError, match="not in an elastic job"):
        elastic.run_remote(len)
    with pytest.raises(ConfigError, match="not started"):
        elastic.run(len)
    with pytest.raises(ValueError, match="use_gpu"):
        ray_module.RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="num_workers or num_hosts"):
        ray_module.RayExecutor(settings, num_workers=2, num_hosts=2)
    with pytest.raises(ConfigError, match="not started"):
        ray_module.RayExecutor(settings, num_workers=2).run(len)


def test_elastic_driver_lines_name_the_executors_parameters(ray_module: Any) -> None:
    from hora.ray.elastic import in_ray_terms

    assert in_ray_terms("fewer than 3 slots (--min-np) for --elastic-timeout 5s; see --max-np, --reset-limit") == \
        "fewer than 3 slots (min_workers) for elastic_timeout 5s; see max_workers, reset_limit"
    assert in_ray_terms("only 1 of the 2 slots (-np)") == "only 1 of the 2 slots (min_workers)"


def test_spark_run_refuses_what_it_cannot_do(spark_module: Any) -> None:
    from hora.errors import ConfigError

    with pytest.raises(ConfigError, match="no MPI"):
        spark_module.run(len, use_mpi=True)
    with pytest.raises(ConfigError, match="Gloo is hora's only controller"):
        spark_module.run(len, use_gloo=False)
    with pytest.raises(ConfigError, match="barrier stage"):
        spark_module.run_elastic(len, num_proc=2)
    if not java_missing():  # no SparkContext in this process: the error says to create one
        with pytest.raises(ConfigError, match="no active SparkContext"):
            spark_module.run(len, num_proc=2)
