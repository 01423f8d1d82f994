"""``hvd.init()`` under launchers other than hora's: torchrun, horovodrun-style, Open MPI, MPICH, Slurm.

Each test starts two real processes the way that launcher would (the variables it sets), runs one allreduce
and checks what every rank reports.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent(
    """
    import os, torch, hora as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    line = (f"rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
            f"cross={hvd.cross_rank()}/{hvd.cross_size()} sum={total}\\n")
    os.write(1, line.encode())  # one write: under torchrun both ranks share one pipe
    hvd.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    drop = ("HORA_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "MPI_LOCAL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run_pair(tmp_path: Path, per_rank: list[dict[str, str]]) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script)], env={**_clean_env(), **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for extra in per_rank]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("ranks hung")
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


EXPECTED = ["rank=0 size=2 local=0/2 cross=0/1 sum=1.0", "rank=1 size=2 local=1/2 cross=0/1 sum=1.0"]


def test_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=_clean_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("rank=")) == EXPECTED


@pytest.mark.parametrize(
    "style",
    ["horovod", "openmpi", "mpich", "slurm"],
)
def test_launcher_variables(tmp_path: Path, style: str) -> None:
    port = str(_free_port())
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    ranks: list[dict[str, str]] = []
    for r in range(2):
        if style == "horovod":
            env = {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                   "HOROVOD_LOCAL_SIZE": "2", **master}
        elif style == "openmpi":
            env = {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **master}
        elif style == "mpich":
            env = {"PMI_RANK": str(r), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": "2",
                   **master}
        else:  # Slurm: the store goes to the first node of the nodelist unless MASTER_ADDR says otherwise
            env = {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
                   "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "7",
                   "MASTER_PORT": port}
        ranks.append(env)
    assert _run_pair(tmp_path, ranks) == EXPECTED


def test_plain_python_is_a_single_process(tmp_path: Path) -> None:
    assert _run_pair(tmp_path, [{}]) == ["rank=0 size=1 local=0/1 cross=0/1 sum=0.0"]


def test_missing_rendezvous_address_is_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**_clean_env(), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "set MASTER_ADDR" in out.stderr and "Open MPI" in out.stderr
