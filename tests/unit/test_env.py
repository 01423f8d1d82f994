"""Launcher detection in hora.common.env: which variables win, what each launcher's variables mean, clear errors."""

from __future__ import annotations

import pytest

from hora.common.env import WorkerEnv
from hora.common.knobs import KNOBS, Knobs, knobs_markdown
from hora.common.slurm import expand_nodelist, parse_tasks_per_node
from hora.errors import ConfigError

MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}


def test_no_launcher_means_a_single_process() -> None:
    env = WorkerEnv.from_environ({"HORA_HOSTNAME": "box"})
    assert (env.rank, env.size, env.local_rank, env.local_size, env.source) == (0, 1, 0, 1, "single")
    assert env.hostname == "box" and env.host_key == "box"


def test_hora_launcher_variables() -> None:
    env = WorkerEnv.from_environ({
        "HORA_RANK": "5", "HORA_SIZE": "8", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "4",
        "HORA_CROSS_RANK": "1", "HORA_CROSS_SIZE": "2", "HORA_STORE_ADDR": "10.1.2.3", "HORA_STORE_PORT": "4567",
        "HORA_HOSTNAME": "node1", "HORA_HOST_KEY": "10.1.2.4", "HORA_JOB_ID": "job7",
        # other launchers' variables are ignored when hora's are present
        "RANK": "0", "WORLD_SIZE": "1", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1",
    })
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank, env.cross_size) == (5, 8, 1, 4, 1, 2)
    assert (env.store_addr, env.store_port, env.store_is_server) == ("10.1.2.3", 4567, False)
    assert (env.hostname, env.host_key, env.job_id, env.source) == ("node1", "10.1.2.4", "job7", "hora")


def test_hora_without_cross_ranks_leaves_them_to_init() -> None:
    env = WorkerEnv.from_environ({"HORA_RANK": "0", "HORA_SIZE": "2", "HORA_LOCAL_SIZE": "2"})
    assert env.cross_rank is None and env.cross_size is None


def test_horovodrun_style_variables() -> None:
    env = WorkerEnv.from_environ({
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "hb", **MASTER,
        "RANK": "0", "WORLD_SIZE": "1",  # torchrun's lose to HOROVOD_*
    })
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank, env.cross_size) == (3, 4, 1, 2, 1, 2)
    assert (env.store_addr, env.store_port, env.hostname, env.source) == ("10.0.0.1", 1234, "hb", "horovod")


def test_torchrun_variables() -> None:
    env = WorkerEnv.from_environ({
        "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "rdzv1", **MASTER,
        "SLURM_PROCID": "0", "SLURM_NTASKS": "2",  # torchrun inside an srun allocation: torchrun's win
    })
    assert (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank) == (6, 8, 2, 4, 1)
    assert (env.store_addr, env.store_port, env.store_is_server) == ("10.0.0.1", 1234, True)
    assert (env.job_id, env.source) == ("rdzv1", "torchrun")


def test_torchrun_agent_store_is_not_served_by_rank_0() -> None:
    env = WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                  "TORCHELASTIC_USE_AGENT_STORE": "True", **MASTER})
    assert env.store_is_server is False


def test_torchrun_default_port_and_missing_address() -> None:
    env = WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h0"})
    assert (env.store_addr, env.store_port) == ("h0", 29500)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})


def test_kubeflow_pod_index_is_not_taken_for_a_process_rank() -> None:
    # PyTorchJob sets RANK to the pod index and PET_NPROC_PER_NODE to the processes per pod
    with pytest.raises(ConfigError, match=r"(?i)kubeflow pod index"):
        WorkerEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "PET_NPROC_PER_NODE": "4", **MASTER})
    # once torchrun runs inside the pod, LOCAL_RANK is set and RANK is a process rank again
    env = WorkerEnv.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                  "PET_NPROC_PER_NODE": "4", **MASTER})
    assert (env.rank, env.local_rank) == (5, 1)


def test_open_mpi_variables() -> None:
    env = WorkerEnv.from_environ({
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **MASTER,
    })
    assert (env.rank, env.size, env.local_rank, env.local_size, env.source) == (3, 4, 1, 2, "Open MPI")


def test_mpich_and_intel_mpi_variables() -> None:
    env = WorkerEnv.from_environ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0",
                                  "MPI_LOCALNRANKS": "1", **MASTER})
    assert (env.rank, env.size, env.local_rank, env.local_size, env.source) == (2, 3, 0, 1, "MPICH/Intel MPI")
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        WorkerEnv.from_environ({"PMI_RANK": "0", "PMI_SIZE": "3"})


def test_slurm_variables_with_nodelist_expansion() -> None:
    env = WorkerEnv.from_environ({
        "SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[07-09],cpu1", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_ID": "4242",
        "SLURMD_NODENAME": "gpu09",
    })
    assert (env.rank, env.size, env.local_rank, env.local_size, env.source) == (5, 7, 1, 2, "Slurm")
    assert env.store_addr == "gpu07"  # the first node of the allocation hosts the store
    assert env.store_port == 29500 + 4242 % 1000
    assert (env.hostname, env.job_id) == ("gpu09", "4242")
    last = WorkerEnv.from_environ({"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_NODEID": "3",
                                   "SLURM_JOB_NODELIST": "gpu[07-09],cpu1", "SLURM_TASKS_PER_NODE": "2(x3),1"})
    assert last.local_size == 1
    explicit = WorkerEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a,b",
                                       **MASTER})
    assert (explicit.store_addr, explicit.store_port) == ("10.0.0.1", 1234)


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("rack1-[1-2]-ib", ["rack1-1-ib", "rack1-2-ib"]),
    ("solo", ["solo"]),
    ("a[1,3],b[2-3]", ["a1", "a3", "b2", "b3"]),
    ("", []),
])
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_parse_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("two")


@pytest.mark.parametrize(("environ", "needle"), [
    ({"HORA_RANK": "2", "HORA_SIZE": "2"}, "rank 2 is outside 0..1"),
    ({"HORA_RANK": "0", "HORA_SIZE": "0"}, "world size must be >= 1"),
    ({"HORA_RANK": "x", "HORA_SIZE": "2"}, "HORA_RANK='x' is not an integer"),
    ({"HORA_RANK": "0"}, "HORA_SIZE is required"),
    ({"HORA_RANK": "0", "HORA_SIZE": "2", "HORA_LOCAL_RANK": "3", "HORA_LOCAL_SIZE": "2"}, "local rank 3"),
    ({"RANK": "4", "WORLD_SIZE": "4", **MASTER}, "from torchrun variables"),
])
def test_bad_values_are_clear_errors(environ: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        WorkerEnv.from_environ(environ)


def test_knobs_defaults_hora_names_and_horovod_aliases() -> None:
    assert Knobs.from_environ({}) == Knobs()
    k = Knobs.from_environ({"HOROVOD_FUSION_THRESHOLD": "1024", "HORA_LOG_LEVEL": "debug",
                            "HOROVOD_LOG_LEVEL": "error", "HOROVOD_STALL_CHECK_DISABLE": "1",
                            "HORA_STALL_CHECK_TIME_SECONDS": "2.5"})
    assert (k.fusion_threshold, k.log_level, k.stall_check_disable, k.stall_check_time_seconds) == \
        (1024, "debug", True, 2.5)
    assert Knobs.from_environ({"HOROVOD_CACHE_CAPACITY": "0"}).disable_cache is True
    assert Knobs.from_environ({"HOROVOD_CACHE_CAPACITY": "1024"}).disable_cache is False
    with pytest.raises(ConfigError, match="HORA_STALL_CHECK_DISABLE='maybe'"):
        Knobs.from_environ({"HORA_STALL_CHECK_DISABLE": "maybe"})
    with pytest.raises(ConfigError, match="HORA_FUSION_THRESHOLD"):
        Knobs.from_environ({"HORA_FUSION_THRESHOLD": "lots"})


def test_knob_docs_list_every_knob() -> None:
    doc = knobs_markdown()
    for knob in KNOBS:
        assert f"`{knob.name}`" in doc


def test_knob_defaults_are_written_once_in_the_table() -> None:
    defaults = Knobs()
    for knob in KNOBS:
        value = getattr(defaults, knob.name[len("HORA_"):].lower())
        assert value == knob.default and type(value) is knob.type, knob.name


def test_a_torchrun_restart_gets_store_keys_of_its_own() -> None:
    """torchrun --max-restarts keeps its store: a restarted attempt must not meet the last attempt's keys."""
    base = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "rdzv1", **MASTER}
    assert WorkerEnv.from_environ({**base, "TORCHELASTIC_RESTART_COUNT": "0"}).job_id == "rdzv1"
    assert WorkerEnv.from_environ({**base, "TORCHELASTIC_RESTART_COUNT": "2"}).job_id == "rdzv1/attempt2"
