"""Launcher detection in hora.common.env: which variables win, what each launcher's variables mean, clear errors."""

from __future__ import annotations

import pytest

from hora.common.env import WorkerEnv
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


def test_a_torchrun_restart_gets_store_keys_of_its_own() -> None:
    """torchrun --max-restarts keeps its store: a restarted attempt must not meet the last attempt's keys."""
    base = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "rdzv1", **MASTER}
    assert WorkerEnv.from_environ({**base, "TORCHELASTIC_RESTART_COUNT": "0"}).job_id == "rdzv1"
    assert WorkerEnv.from_environ({**base, "TORCHELASTIC_RESTART_COUNT": "2"}).job_id == "rdzv1/attempt2"
