"""Which of hora's files one steady-state op runs through, on every thread, under ``hora run -np 2``.

Each rank builds a small model and its ``DistributedOptimizer``, warms up, then records every Python function
entered on every thread (``sys.setprofile`` on the main thread, ``threading.setprofile`` on the threads hora
starts at ``init()``) while it runs a few synchronous ``hvd.allreduce`` calls of a 4-element tensor, then (a
second window) a few optimizer steps. A file counts once some function of it is entered, on any thread of any
rank, inside the window. Threads that run by the clock (the negotiator parking, its timers) may or may not
enter the window, so a count moves by one or two between runs.

    .venv/bin/python benchmarks/op_walk.py [--why] [--quick] [--out DIR]

``--why`` also names, per file, the first function entered and who called it, on which thread, and every
function of the file entered in the window (rank 0's, or the first rank that entered the file). Writes
``op_walk.{json,md}`` to benchmarks/results (``--out`` elsewhere). Not a timing: nothing here is measured in
seconds. The ranks are this file run with ``--rank-out DIR`` (``hora run`` starts them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

WALKS = ("allreduce", "optimizer")
WARMUP = 20
STEPS = 5
_PACKAGE = "/hora/"


class _Tracer:
    """The hora files entered while ``on``, in first-entry order, each with its first function and caller."""

    def __init__(self) -> None:
        self.on = False
        self.seen: dict[str, str] = {}
        self.functions: dict[str, dict[str, None]] = {}  # every function entered, per file, in first-entry order

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        cut = path.rfind(_PACKAGE)
        if cut < 0 or "/site-packages/" in path[cut:]:
            return
        key = path[cut + len(_PACKAGE):]
        self.functions.setdefault(key, {})[frame.f_code.co_name] = None
        if key not in self.seen:
            back = frame.f_back
            caller = f"{back.f_code.co_filename.rsplit('/', 2)[-1]}:{back.f_code.co_name}" if back else "?"
            self.seen[key] = f"{frame.f_code.co_name} <- {caller} [{threading.current_thread().name}]"


def _rank(out: Path, steps: int) -> None:
    tracer = _Tracer()
    threading.setprofile(tracer)  # the threads hora starts at init() (the negotiator, the timers ...)
    sys.setprofile(tracer)
    import torch

    import hora as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(16, 64)
    sync = torch.ones(1)

    def allreduce() -> None:
        hvd.allreduce(torch.ones(4))

    def optimizer() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    walks: dict[str, dict[str, str]] = {}
    for name, one in (("allreduce", allreduce), ("optimizer", optimizer)):
        for _ in range(WARMUP):
            one()
            hvd.allreduce(sync, name="op_walk.sync")  # a name every rank has sent before: cached, as in the window
        tracer.seen, tracer.functions = {}, {}
        tracer.on = True
        for _ in range(steps):
            one()
        tracer.on = False
        hvd.allreduce(sync, name="op_walk.sync")  # no rank leaves its window while a peer still runs in its own
        walks[name] = {f: f"{why}; all: {', '.join(tracer.functions[f])}" for f, why in tracer.seen.items()}
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(walks))
    hvd.shutdown()


def walks(np: int = 2, steps: int = STEPS, timeout: float = 300) -> dict[str, dict[str, str]]:
    """Run the job under ``hora run -np NP``: per walk, each file any rank entered (rank 0's first, in order of
    first entry) with its first function, caller and thread."""
    with tempfile.TemporaryDirectory(prefix="hora-op-walk-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", str(np), sys.executable, __file__,
                               "--rank-out", tmp, "--steps", str(steps)],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"hora run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(np)]
    merged: dict[str, dict[str, str]] = {}
    for walk in WALKS:
        files: dict[str, str] = {}
        for rank in per_rank:
            for f, why in rank[walk].items():
                files.setdefault(f, why)
        merged[walk] = files
    return merged


def _markdown(found: dict[str, dict[str, str]], info: dict[str, Any]) -> str:
    lines = ["# hora's files one steady-state op runs through (every thread, `hora run -np 2`)", "",
             f"commit {info['git_commit']}, {info['utc']}", ""]
    for walk, files in found.items():
        lines += [f"## {walk}: {len(files)} files", "",
                  "| # | file | first function <- caller [thread]; all: each function entered |", "|---|---|---|"]
        lines += [f"| {i} | `{f}` | `{why}` |" for i, (f, why) in enumerate(files.items(), 1)]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    from common import add_output_flags, machine_info, output_dir, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS, help="ops (or optimizer steps) in each window")
    parser.add_argument("--why", action="store_true",
                        help="print each file's first function, its caller, and every function entered")
    parser.add_argument("--rank-out", type=Path, default=None, help=argparse.SUPPRESS)  # a rank of the job
    add_output_flags(parser, "two ops per window")
    args = parser.parse_args()
    if args.rank_out is not None:
        _rank(args.rank_out, args.steps)
        return
    found = walks(args.np, 2 if args.quick else args.steps)
    for walk, files in found.items():
        print(f"{walk}: {len(files)} files")
        for f, why in files.items():
            print(f"    {f:36s} {why}" if args.why else f"    {f}")
    info = machine_info()
    write_results("op_walk", {"machine": info, "np": args.np, "walks": found}, _markdown(found, info),
                  out_dir=output_dir(args))


if __name__ == "__main__":
    main()
