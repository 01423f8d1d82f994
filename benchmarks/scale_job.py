"""A 128-rank job on this machine, ten times, then once with one rank killed: does it start, compute exactly,
end cleanly and say nothing, and does a SIGKILL end it naming the rank, with the others told at once and no
process left?

Each run is :func:`hora.bench.scale_job.run_job` in a process of its own (its ranks forked from it), whose
stdout and stderr are read here: per run, the exit status, the lines on stderr that look like errors
(``error``, ``Traceback``, ``exception``, any case), the wall time, the slowest rank's ``init()``, a rank's
private memory and the load average before and after. A clean run passes when it exits 0, every result is
exact, no error line was printed and no rank's process is left; the kill run when the harness's report names
the killed rank, every other rank got the error naming it (and how long after the kill), every result before
was exact and no process is left.

First, one rank of ``hora run -np 2`` (a fresh interpreter, as ``hora run`` and ``hora.run`` start them)
measures its private memory: times 128 it says whether ``hora run -np 128`` fits here; the runs use forked
ranks, which share torch's pages with their parent.

    python benchmarks/scale_job.py --np 128 --runs 10 [--steps 10] [--per-step 100] [--quick] [--out DIR]

The exit status is 1 when any run failed its check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_output_flags, machine_info, markdown_table, output_dir, write_results

from hora.bench.scale_job import ScaleJob, run_job

ERROR_LINE = re.compile(r"error|traceback|exception", re.IGNORECASE)
_MEMORY_PROBE = ("import torch, hora; hora.init(); hora.allreduce(torch.ones(4), name='x'); "
                 "from hora.bench.scale_job import private_mb; print('private_mb', private_mb(), flush=True); "
                 "hora.shutdown()")


def fresh_rank_private_mb() -> float:
    """The private memory of one rank of ``hora run -np 2`` after an allreduce, in MB."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp, "probe.py")
        probe.write_text(_MEMORY_PROBE)
        out = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(probe)],
                             capture_output=True, text=True, timeout=300, check=True).stdout
    return max(float(m) for m in re.findall(r"private_mb ([0-9.]+)", out))


def one_run(job: ScaleJob) -> dict[str, Any]:
    """One job in a process of its own; what it printed on stderr is read from the outside."""
    load = os.getloadavg()[0]
    began = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(job.__dict__)], capture_output=True,
                          text=True, timeout=job.timeout_s + 120)
    wall = time.monotonic() - began
    result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    errors = [line for line in proc.stderr.splitlines() if ERROR_LINE.search(line)]
    row = {"exit": proc.returncode, "error_lines": errors, "stderr_lines": len(proc.stderr.splitlines()),
           "stderr_head": proc.stderr.splitlines()[:40],
           "wall_s": wall, "load": [load, os.getloadavg()[0]], **result}
    row["passed"] = _passed(job, row)
    return row


def _passed(job: ScaleJob, row: dict[str, Any]) -> bool:
    if not row.get("exact") or row.get("left_behind"):
        return False
    if job.kill_rank is None:
        return row["exit"] == 0 and row.get("ok", False) and not row["error_lines"]
    named = f"rank {job.kill_rank} died without reporting (killed by SIGKILL)" in row.get("report", "")
    told = len(row.get("survivors", {})) == job.ranks - 1 and all(
        f"rank {job.kill_rank} on host" in e for e in row["survivors"].values())
    return named and told


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["run", "passed", "exit", "error lines", "stderr lines", "exact", "left behind", "init (slowest)",
            "wall", "private MB/rank", "told after (max)", "load"]
    body = [[r["run"], "yes" if r["passed"] else "NO", r["exit"], len(r["error_lines"]), r["stderr_lines"],
             "yes" if r.get("exact") else "no", len(r.get("left_behind", [])), f"{r.get('init_s', 0):.1f} s",
             f"{r['wall_s']:.1f} s", f"{r.get('private_mb', 0):.0f}",
             f"{max(r['told_after_s']) * 1000:.0f} ms" if r.get("told_after_s") else "",
             f"{r['load'][0]:.0f}-{r['load'][1]:.0f}"] for r in rows]
    return markdown_table(head, body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=128)
    parser.add_argument("--runs", type=int, default=10, help="clean runs (then one run with a rank killed)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--per-step", type=int, default=100, help="allreduces submitted together per step")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one job, print its result as JSON
    add_output_flags(parser, "16 ranks, 2 clean runs")
    args = parser.parse_args()
    if args.one:
        result = run_job(ScaleJob(**json.loads(args.one)))
        print(json.dumps(result.as_dict()), flush=True)
        return 0 if result.ok else 1
    if args.quick:
        args.np, args.runs = 16, 2
    fresh = fresh_rank_private_mb()
    print(f"scale_job: one rank of `hora run` holds {fresh:.0f} MB of its own: x{args.np} = "
          f"{fresh * args.np / 1024:.1f} GB; the runs fork their ranks", file=sys.stderr)
    jobs = [ScaleJob(ranks=args.np, steps=args.steps, per_step=args.per_step)] * args.runs
    jobs.append(ScaleJob(ranks=args.np, steps=args.steps, per_step=args.per_step, kill_rank=args.np // 2 + 1))
    rows = []
    for n, job in enumerate(jobs, 1):
        row = {"run": n if job.kill_rank is None else f"kill rank {job.kill_rank}", **one_run(job)}
        rows.append(row)
        print(f"scale_job: run {row['run']}: {'passed' if row['passed'] else 'FAILED'} (exit {row['exit']}, "
              f"{len(row['error_lines'])} error lines, {row['wall_s']:.1f} s)", file=sys.stderr)
    markdown = (f"{args.np} ranks (forked), {args.steps} steps x {args.per_step} named allreduces each "
                f"({args.steps * args.per_step} in all); one rank of `hora run` holds {fresh:.0f} MB of its own "
                f"(x{args.np} = {fresh * args.np / 1024:.1f} GB).\n\n" + _table(rows) + "\n")
    data = {"machine": machine_info(), "ranks": args.np, "steps": args.steps, "per_step": args.per_step,
            "fresh_rank_private_mb": fresh, "runs": rows}
    write_results("scale_job", data, markdown, out_dir=output_dir(args))
    print(markdown)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
