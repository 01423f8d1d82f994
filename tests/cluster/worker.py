"""The training script of the cluster tests: init, one real allreduce, then report or keep going.

    python worker.py report [--api torch]     print one ``REPORT {json}`` line (rank, topology, hostname,
                                              the allreduced sum), exit 0
    python worker.py loop DIR [--api torch]   after the first allreduce write ``DIR/ready.<rank>`` (json, with
                                              the pid), then allreduce every 0.1 s until something kills the job

``--api hora`` (default) uses ``hora.init``/``hora.allreduce`` as a user's script does, ``--api horovod`` the same
through ``import horovod.torch as hvd`` (an unchanged Horovod script); ``--api torch`` uses plain
torch.distributed on the launcher's store (``HORA_STORE_ADDR``/``PORT``), so launcher failures can be tested
apart from hora's worker core.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch


class TorchApi:
    """The few calls the tests need, on a plain Gloo process group built from hora's launcher variables."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        env = os.environ
        self.rank, self.size = int(env["HORA_RANK"]), int(env["HORA_SIZE"])
        store = dist.TCPStore(env["HORA_STORE_ADDR"], int(env["HORA_STORE_PORT"]), is_master=False)
        prefixed = dist.PrefixStore(f"cluster-test/{env['HORA_JOB_ID']}", store)
        dist.init_process_group("gloo", store=prefixed, rank=self.rank, world_size=self.size)
        self.topology = {
            k: int(env[f"HORA_{k.upper()}"]) for k in ("local_rank", "local_size", "cross_rank", "cross_size")
        }

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        out = tensor.clone()
        self.dist.all_reduce(out)
        return out

    def shutdown(self) -> None:
        self.dist.destroy_process_group()


class HoraApi:
    """The same calls through hora, as a Horovod user writes them (``horovod=True``: through
    ``import horovod.torch as hvd``, which resolves to hora under ``hora run`` when Horovod is absent)."""

    def __init__(self, horovod: bool = False) -> None:
        if horovod:
            import horovod.torch as hvd
        else:
            import hora as hvd

        self.hvd = hvd
        self.module_file = hvd.__file__  # where `hvd` came from
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.topology = {
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(),
        }

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)

    def shutdown(self) -> None:
        self.hvd.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["report", "loop"])
    parser.add_argument("dir", nargs="?")
    parser.add_argument("--api", choices=["hora", "horovod", "torch"], default="hora")
    args = parser.parse_args()
    api: Any = TorchApi() if args.api == "torch" else HoraApi(horovod=args.api == "horovod")
    total = api.allreduce_sum(torch.tensor([float(api.rank + 1)]), name="first")
    report = {
        "rank": api.rank,
        "size": api.size,
        **api.topology,
        "hostname": socket.gethostname(),
        "sum": total.item(),
        "pid": os.getpid(),
        "horovod_hostname": os.environ.get("HOROVOD_HOSTNAME"),
        "module_file": api.module_file,
    }
    if args.mode == "report":
        print("REPORT " + json.dumps(report), flush=True)
        api.shutdown()
        return 0
    ready = Path(args.dir) / f"ready.{api.rank}"
    tmp = ready.parent / f"{ready.name}.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(ready)  # readers never see half a file
    step = 0
    while True:
        step += 1
        api.allreduce_sum(torch.ones(4), name=f"step.{step}")
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
