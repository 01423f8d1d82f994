"""The two bugs found while deploying (issue 14): numpy as a dependency, an unresolvable rendezvous host."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement


def test_numpy_is_a_declared_dependency() -> None:
    # init() with more than one rank gathers Python objects, which torch turns into bytes through numpy:
    # a venv with only torch and hora failed with "Numpy is not available".
    names = {Requirement(r).name for r in metadata.requires("hora") or () if "extra ==" not in r}
    assert "numpy" in names


def test_unresolvable_first_slurm_node_fails_fast_naming_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "SLURM_", "MASTER_", "OMPI_", "PMI_"))}
    env.update({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "SLURM_NODEID": "1",
                "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": "nohost-hora[1-2].invalid",
                "HORA_START_TIMEOUT": "600"})
    # Without the check the rank retried the store connection for HORA_START_TIMEOUT (600 s here); the
    # subprocess timeout is far below that.
    out = subprocess.run([sys.executable, "-c", "import hora; hora.init()"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "nohost-hora1.invalid" in out.stderr and "does not resolve" in out.stderr, out.stderr[-2000:]
    assert "MASTER_ADDR" in out.stderr and "SLURM_JOB_NODELIST" in out.stderr
