"""The training script of the stall tests (tests/diagnostics/test_hora_run_stall.py on one host,
tests/cluster/test_stall_hosts.py across hosts): one rank never reaches the second allreduce, stuck in a
function whose name the report must show."""

from __future__ import annotations

from pathlib import Path

_SCRIPT = """
import time
import torch
import hora as hvd


def stuck_in_data_loader():
    time.sleep(600)


hvd.init()
hvd.allreduce(torch.ones(2), name="warmup")
if hvd.rank() == {stuck_rank}:
    stuck_in_data_loader()
hvd.allreduce(torch.ones(2), name="loss")
"""


def write_stalled_script(folder: Path, stuck_rank: int) -> Path:
    """Write ``train.py`` into ``folder``: every rank allreduces 'warmup', then rank ``stuck_rank`` sleeps in
    ``stuck_in_data_loader`` while the others wait for it in allreduce 'loss'. Returns its path."""
    script = folder / "train.py"
    script.write_text(_SCRIPT.format(stuck_rank=stuck_rank))
    return script
