"""Worker of benchmarks/startup_bench.py: init, one allreduce, write when it completed, exit.

    python startup_worker.py hora DIR     hora.init + hora.allreduce (under `hora run`)
    python startup_worker.py torch DIR    init_process_group("gloo") + all_reduce (under torchrun)
Each rank writes DIR/first.<rank> holding time.time() right after its first allreduce completed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def main() -> int:
    api, out = sys.argv[1], Path(sys.argv[2])
    if api == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        import hora as hvd

        hvd.init()
        tensor = hvd.allreduce(torch.ones(1), op=hvd.Sum)
        rank, size = hvd.rank(), hvd.size()
    done = time.time()
    if tensor.item() != size:
        raise SystemExit(f"rank {rank}: allreduce gave {tensor.item()}, expected {size}")
    (out / f"first.{rank}").write_text(repr(done))
    if api == "torch":
        dist.destroy_process_group()
    else:
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
