"""Elastic recovery: hora's in-process elastic mode against torchrun's restart, on the same script.

Three figures, each from one run on this machine, with the load average beside it:

* recovery: from a SIGKILL of one worker to the survivors' next completed step (every survivor done with a
  step in the new world), median and max over ``--trials`` kills. hora: ``hora run --min-np 2 -H
  127.0.0.1:2,127.0.0.2:2 --blacklist-cooldown-range 1 1`` (two "hosts" on loopback addresses, no ssh; the
  killed worker's host is blacklisted for about a second, then comes back, so every trial starts from 4
  workers). torchrun: ``torchrun --nnodes=1:2 --nproc-per-node=4 --max-restarts=N`` (c10d rendezvous): it
  restarts every worker; its figure is from the kill to the restarted workers' first step (they start again
  from step 0: torchrun keeps no in-memory state).
* scale-up: while the blacklisted host's new workers start (import torch, build) and join, the survivors'
  longest gap between two steps.
* no-event overhead: the median step time of the same script under ``hora run -np 4 --min-np 4`` (elastic,
  nothing happens) over ``hora run -np 4`` (fixed), alternating A B A B.

The worker is benchmarks/elastic_worker.py (hvd.elastic.run + TorchState, a commit every step).

    python benchmarks/elastic_bench.py [--trials 10] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import add_output_flags, machine_info, markdown_table, output_dir, summarize, write_results

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "elastic_worker.py")
PYTHON = sys.executable
HORA = [PYTHON, "-m", "hora", "run"]
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]
WAIT_S = 300.0


class Job:
    """One launcher in its own session; the workers write OUT/steps.jsonl."""

    def __init__(self, argv: list[str], out: Path) -> None:
        self.out = out
        self.log = out / "launcher.log"
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=HERE.parent)
        self._offset = 0
        self.steps: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        path = self.out / "steps.jsonl"
        if path.exists():
            with path.open() as fh:
                fh.seek(self._offset)
                data = fh.read()
            done = data.rfind("\n") + 1
            self._offset += done
            self.steps.extend(json.loads(line) for line in data[:done].splitlines() if line.strip())
        return self.steps

    def wait_for(self, what: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.read()):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"never saw {what}; launcher output:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        (self.out / "stop").touch()
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def kill(self) -> None:
        """End the launcher: SIGTERM first (torchrun stops its workers, which live in sessions of their own),
        then SIGKILL its session; then any worker that recorded a step and still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in {s["pid"] for s in self.read()}:
            try:  # a process id is reused quickly on a busy machine: only ever this benchmark's worker
                if WORKER in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass


def _live(steps: list[dict[str, Any]], since: float) -> dict[int, dict[str, Any]]:
    """pid -> its latest step after ``since``."""
    latest: dict[int, dict[str, Any]] = {}
    for s in steps:
        if s["t"] > since:
            latest[s["pid"]] = s
    return latest


def _full_world(job: Job, since: float, size: int, min_steps: int) -> dict[int, dict[str, Any]]:
    """Wait until ``size`` processes each made ``min_steps`` steps in a world of ``size`` after ``since``."""
    found: dict[int, dict[str, Any]] = {}

    def ready(steps: list[dict[str, Any]]) -> bool:
        counts: dict[int, int] = {}
        for s in steps:
            if s["t"] > since and s["size"] == size:
                counts[s["pid"]] = counts.get(s["pid"], 0) + 1
                found[s["pid"]] = s
        return sum(1 for c in counts.values() if c >= min_steps) >= size

    job.wait_for(f"{size} workers stepping", ready)
    return found


def hora_kills(trials: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "hora"
    out.mkdir()
    job = Job([*HORA, "--min-np", "2", "-H", "127.0.0.1:2,127.0.0.2:2", "--blacklist-cooldown-range", "1", "1",
               PYTHON, WORKER, str(out), "--sleep", "0.02"], out)
    recovery, gaps, loads = [], [], []
    try:
        since = 0.0
        for trial in range(trials):
            world = _full_world(job, since, 4, 5)
            world_pids = list(world)
            victim = next(s for s in world.values() if s["host"] == "127.0.0.2")
            survivors = {pid for pid, s in world.items() if s["host"] == "127.0.0.1"}
            loads.append(os.getloadavg()[0])
            killed = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            job.wait_for("the survivors' next step", lambda steps, survivors=survivors, killed=killed: survivors <= {
                s["pid"] for s in steps if s["t"] > killed and s["size"] == 2})
            firsts = {}
            for s in job.steps:
                if s["t"] > killed and s["size"] == 2 and s["pid"] in survivors:
                    firsts.setdefault(s["pid"], s["t"])
            recovery.append(max(firsts.values()) - killed)
            # scale-up: the host comes back (cooldown ~1 s), its new workers import and join
            grown = time.time()
            world = _full_world(job, killed, 4, 2)
            before = set(world_pids)
            joined = min(s["t"] for s in job.steps if s["t"] > killed and s["size"] == 4 and s["pid"] not in before)
            times = sorted(s["t"] for s in job.steps if s["pid"] in survivors and killed < s["t"] <= joined + 1.0)
            gaps.append(max((b - a for a, b in zip(times, times[1:])), default=0.0))
            print(f"hora trial {trial}: recovery {recovery[-1]:.2f} s, longest survivor gap while the host "
                  f"rejoined {gaps[-1]:.2f} s (load {loads[-1]:.1f}; waited {joined - grown:.1f} s for the join)",
                  flush=True)
            since = joined
        code = job.stop()
    finally:
        job.kill()
    return {"recovery_s": recovery, "scale_up_gap_s": gaps, "load_1min": loads, "exit_code": code}


def torchrun_kills(trials: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "torchrun"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = Job([*TORCHRUN, "--nnodes=1:2", "--nproc-per-node=4", f"--max-restarts={trials + 2}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-bench",
               WORKER, str(out), "--sleep", "0.02"], out)
    recovery, loads, failed = [], [], []
    done: set[int] = set()  # processes of earlier attempts (torchrun stopped them)
    try:
        since = 0.0
        for trial in range(trials):
            try:
                world = _full_world(job, since, 4, 5)
            except RuntimeError as exc:
                failed.append(f"trial {trial}: the restarted workers never stepped: {str(exc)[:300]}")
                break
            victim = next(s for pid, s in world.items() if pid not in done)
            loads.append(os.getloadavg()[0])
            killed = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            old = set(world)
            try:
                job.wait_for("the restarted workers' first step", lambda steps, killed=killed, old=old: len(
                    {s["pid"] for s in steps if s["t"] > killed and s["pid"] not in old}) >= 4)
            except RuntimeError as exc:
                failed.append(f"trial {trial}: {str(exc)[:300]}")
                break
            firsts: dict[int, float] = {}
            for s in job.steps:
                if s["t"] > killed and s["pid"] not in old:
                    firsts.setdefault(s["pid"], s["t"])
            recovery.append(sorted(firsts.values())[3] - killed)
            print(f"torchrun trial {trial}: restart to the next step {recovery[-1]:.2f} s (load {loads[-1]:.1f})",
                  flush=True)
            since, done = max(firsts.values()), done | old
    finally:
        job.kill()
    return {"recovery_s": recovery, "load_1min": loads, "failures": failed}


def step_time(elastic: bool, steps: int, tmp: Path, index: int) -> float:
    out = tmp / f"overhead{index}"
    out.mkdir()
    flags = ["-np", "4", "--min-np", "4"] if elastic else ["-np", "4"]
    job = Job([*HORA, *flags, PYTHON, WORKER, str(out), "--steps", str(steps), "--sleep", "0"], out)
    try:
        code = job.proc.wait(timeout=WAIT_S)
    finally:
        job.kill()
    if code != 0:
        raise RuntimeError(f"overhead run ({'elastic' if elastic else 'fixed'}) failed: "
                           f"{job.log.read_text()[-3000:]}")
    times = sorted(s["t"] for s in job.read() if s["rank"] == 0)[steps // 5:]  # skip the warm-up
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10, help="kills per launcher (default 10)")
    p.add_argument("--steps", type=int, default=300, help="steps per no-event overhead run")
    p.add_argument("--pairs", type=int, default=2, help="fixed/elastic run pairs for the overhead")
    p.add_argument("--skip-torchrun", action="store_true")
    add_output_flags(p, "2 kills each, 60-step overhead runs, 1 pair")
    args = p.parse_args(argv)
    if args.quick:
        args.trials, args.steps, args.pairs = 2, 60, 1
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="elastic-bench-", ignore_cleanup_errors=True) as tmpdir:
        tmp = Path(tmpdir)
        hora_res = hora_kills(args.trials, tmp)
        torch_res = {"recovery_s": [], "load_1min": [], "failures": ["skipped"]} if args.skip_torchrun \
            else torchrun_kills(args.trials, tmp)
        fixed, elastic = [], []
        for i in range(args.pairs):
            fixed.append(step_time(False, args.steps, tmp, 2 * i))
            elastic.append(step_time(True, args.steps, tmp, 2 * i + 1))
    overhead = [e / f for e, f in zip(elastic, fixed)]
    data = {"machine": machine, "trials": args.trials, "hora": hora_res, "torchrun": torch_res,
            "step_time_fixed_s": fixed, "step_time_elastic_s": elastic, "elastic_over_fixed": overhead,
            "load_avg_end": [round(x, 2) for x in os.getloadavg()]}

    def fmt(samples: list[float]) -> tuple[str, str, str]:
        if not samples:
            return "-", "-", "0"
        s = summarize(samples)
        return f"{s['median']:.2f}", f"{s['max']:.2f}", str(len(samples))

    rows = [
        ["hora: SIGKILL -> survivors' next step (s)", *fmt(hora_res["recovery_s"]), "<= 3 s"],
        ["torchrun --max-restarts: SIGKILL -> restarted workers' first step (s)", *fmt(torch_res["recovery_s"]), "-"],
        ["hora: survivors' longest gap while a host joins (s)", *fmt(hora_res["scale_up_gap_s"]), "<= 1 s"],
        ["step time elastic / fixed, no events (ratio)", *fmt(overhead), "<= 1.02"],
    ]
    loads = hora_res["load_1min"] + torch_res["load_1min"]
    md = [
        "# elastic_bench: recovery from a killed worker, scale-up, no-event overhead",
        "",
        f"One run, {machine['utc']}, commit {machine['git_commit']}, {machine['cpus']} CPUs, "
        f"load average at the kills {min(loads, default=0):.1f}..{max(loads, default=0):.1f} "
        "(other sessions share this machine: every figure is inflated by it).",
        "",
        markdown_table(["figure", "median", "max", "n", "target"], rows),
        "",
        f"hora's job exit code after the kills: {hora_res['exit_code']}. torchrun failures: "
        f"{'; '.join(torch_res['failures']) or 'none'}.",
        "",
        "Setup: 4 workers (benchmarks/elastic_worker.py: hvd.elastic.run, TorchState, a commit every step, "
        "a 20 ms sleep per step), two hosts on loopback addresses for hora (127.0.0.1:2, 127.0.0.2:2, "
        "--blacklist-cooldown-range 1 1: the killed worker's host comes back after about a second); torchrun "
        "with the c10d rendezvous on one node. The overhead rows run 4 workers without sleep.",
        "",
    ]
    paths = write_results("elastic_bench", data, "\n".join(md), out_dir=output_dir(args))
    print("\n".join(md))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
