"""Elastic recovery: hora's in-process elastic mode against torchrun's restart, on the same script, and every
failure test many times in a row.

Each figure is from one run on this machine, with the load average beside it:

* recovery: from a SIGKILL of one worker to the survivors' next completed step (every survivor done with a
  step in the new world), median and max over ``--trials`` kills. hora: ``hora run -np 4 --min-np 2 -H
  localhost:4 --blacklist-cooldown-range 1 1`` (one machine, as docs/elastic.md runs it: the killed worker's
  host takes no new worker for about a second while the other three train on, then its slot gets a new
  worker, so every trial starts from 4 workers). torchrun: ``torchrun --nnodes=1:2 --nproc-per-node=4
  --max-restarts=N`` (c10d rendezvous): it restarts every worker; its figure is from the kill to the
  restarted workers' first step (they start again from step 0: torchrun keeps no in-memory state).
* scale-up: while the failed slot's new worker starts (import torch, build) and joins, the survivors'
  longest gap between two steps.
* no-event overhead: the median step time of the same script under ``hora run -np 4 --min-np 4`` (elastic,
  nothing happens) over ``hora run -np 4`` (fixed), alternating A B A B.
* failures in a row (``--kill-runs N``): each of SIGKILL / an exception, with fixed ``-H`` + ``--min-np`` and
  with a discovery script, N times in one job; each failure checked (survivors recover, the failed worker's
  process is gone, equal parameters on every rank at every step), and the job's end (exit 0, equal final
  parameters, no process left). The exit status is 1 when any of them failed.

The worker is benchmarks/elastic_worker.py (hvd.elastic.run + TorchState, a commit every step). The report
is rewritten after every part, so a run cut short keeps what it measured.

    python benchmarks/elastic_bench.py [--trials 10] [--kill-runs 20] [--torchrun-trials N] [--quick] [--out DIR]
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
        with self.log.open("w") as fh:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=HERE.parent)
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


def _full_world(job: Job, since: float, size: int, min_steps: int, exclude: frozenset[int] = frozenset(),
                timeout: float = WAIT_S) -> dict[int, dict[str, Any]]:
    """Wait until ``size`` processes (not in ``exclude``) each made ``min_steps`` steps in a world of ``size``
    after ``since``; their latest steps by pid."""
    found: dict[int, dict[str, Any]] = {}

    def ready(steps: list[dict[str, Any]]) -> bool:
        counts: dict[int, int] = {}
        for s in steps:
            if s["t"] > since and s["size"] == size and s["pid"] not in exclude:
                counts[s["pid"]] = counts.get(s["pid"], 0) + 1
                found[s["pid"]] = s
        return sum(1 for c in counts.values() if c >= min_steps) >= size

    job.wait_for(f"{size} workers stepping", ready, timeout)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name ([] when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return []


def _descendants(pid: int) -> set[tuple[int, str]]:
    """Every live process below ``pid`` (agents, workers and what they started), as (pid, start time): a pid
    reused later by another process does not count as the same process."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if len(fields) > 19:
                children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found: set[tuple[int, str]] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child[0])
    return found


def _still_running(procs: set[tuple[int, str]]) -> list[int]:
    return sorted(pid for pid, start in procs if (f := _stat(pid)) and len(f) > 19 and f[19] == start
                  and f[0] not in ("Z", "X"))


def _digests_differ(steps: list[dict[str, Any]], since: float) -> list[str]:
    """(world, step) pairs after ``since`` where the ranks' parameters differ."""
    seen: dict[tuple[int, int], set[str]] = {}
    for s in steps:
        if s["t"] > since and "digest" in s:
            seen.setdefault((s["gen"], s["step"]), set()).add(s["digest"])
    return [f"world {g} step {n}" for (g, n), d in sorted(seen.items()) if len(d) > 1]


# (how the worker fails, where the hosts come from)
VARIANTS: dict[str, tuple[str, str]] = {
    "SIGKILL, -H + --min-np": ("kill", "fixed"),
    "raise, -H + --min-np": ("raise", "fixed"),
    "SIGKILL, discovery script": ("kill", "discovery"),
    "raise, discovery script": ("raise", "discovery"),
}
HOSTS = "localhost:4"  # one machine: the failed worker's host-mates train on (docs/elastic.md)
RECOVER_S = 60.0  # a failure whose survivors have not stepped again by then counts as failed
LEAVE_S = 30.0  # the failed worker's process must be gone by then


def _cycle(job: Job, trial: int, how: str, since: float) -> tuple[dict[str, Any], float]:
    """One failure in a world of 4, the survivors' recovery, the failed slot's return; checks each step."""
    world = _full_world(job, since, 4, 3)
    ranked = sorted(world.values(), key=lambda s: s["rank"])
    victim = ranked[0] if trial % 2 else ranked[1 + (trial // 2) % 3]  # rank 0 every other time
    survivors = {pid for pid in world if pid != victim["pid"]}
    doomed = frozenset({victim["pid"]})
    load = os.getloadavg()[0]
    failed_at = time.time()
    if how == "kill":
        os.kill(victim["pid"], signal.SIGKILL)
    else:
        (job.out / f"raise.{victim['wid']}").touch()
    job.wait_for("the survivors' next step", lambda steps: survivors <= {
        s["pid"] for s in steps if s["t"] > failed_at and s["size"] == 3}, RECOVER_S)
    firsts: dict[int, float] = {}
    for s in job.steps:
        if s["t"] > failed_at and s["size"] == 3 and s["pid"] in survivors:
            firsts.setdefault(s["pid"], s["t"])
    deadline = time.monotonic() + LEAVE_S
    while any(_alive(p) for p in doomed) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(p for p in doomed if _alive(p))
    # the host comes back after its cooldown (~1 s): the failed slot's new worker imports, builds and joins
    _full_world(job, failed_at, 4, 2, exclude=doomed)
    joined = min(s["t"] for s in job.steps if s["t"] > failed_at and s["size"] == 4 and s["pid"] not in doomed
                 and s["pid"] not in survivors)
    times = sorted(s["t"] for s in job.steps if s["pid"] in survivors and min(firsts.values()) <= s["t"] <= joined + 1)
    differ = _digests_differ(job.read(), since)
    problems = ([f"the failed worker's process left running: {left}"] if left else []) + (
        [f"parameters differ between ranks at {', '.join(differ[:3])}"] if differ else [])
    record = {"trial": trial, "victim": victim["wid"], "victim_rank": victim["rank"], "load_1min": load,
              "recovery_s": max(firsts.values()) - failed_at,
              "scale_up_gap_s": max((b - a for a, b in zip(times, times[1:])), default=0.0),
              "ok": not problems, "problems": problems}
    return record, joined


def kill_runs(name: str, cycles: int, tmp: Path) -> dict[str, Any]:
    """One elastic job of 4 workers on this machine; ``cycles`` failures in a row (each: a worker fails, the
    survivors recover, the failed slot gets a new worker after its host's cooldown); then the job is stopped and
    must end with exit code 0, equal parameters on every rank and no process left."""
    how, source = VARIANTS[name]
    out = tmp / f"kills-{how}-{source}"
    out.mkdir()
    if source == "fixed":
        hosts = ["-H", HOSTS]
    else:
        listing = out / "hosts.txt"
        listing.write_text(HOSTS + "\n")
        hosts = ["--max-np", "4", "--host-discovery-script", f"cat {listing}"]
    job = Job([*HORA, "-np", "4", "--min-np", "2", *hosts, "--blacklist-cooldown-range", "1", "1",
               PYTHON, WORKER, str(out), "--sleep", "0.02", "--digest"], out)
    trials: list[dict[str, Any]] = []
    result: dict[str, Any] = {"variant": name, "cycles": cycles, "trials": trials}
    seen: set[tuple[int, str]] = set()  # every process seen below the job's launcher (agents, workers)
    try:
        since = 0.0
        for trial in range(cycles):
            try:
                seen |= _descendants(job.proc.pid)
                record, since = _cycle(job, trial, how, since)
                seen |= _descendants(job.proc.pid)
            except RuntimeError as exc:  # the job is in an unknown state: the rest of this variant is not run
                trials.append({"trial": trial, "ok": False, "problems": [str(exc)[:2000]]})
                print(f"{name} {trial}: FAILED: {str(exc)[:300]}", flush=True)
                break
            trials.append(record)
            print(f"{name} {trial}: {'ok' if record['ok'] else 'FAILED: ' + '; '.join(record['problems'])}, "
                  f"recovery {record['recovery_s']:.2f} s, longest survivor gap while the host rejoined "
                  f"{record['scale_up_gap_s']:.2f} s (load {record['load_1min']:.1f})", flush=True)
        seen |= _descendants(job.proc.pid)
        result["exit_code"] = code = job.stop()
        finals = [json.loads(p.read_text()) for p in sorted(out.glob("final.*"))]
        result["final_params_equal"] = bool(finals) and all(f["params"] == finals[0]["params"] for f in finals)
        result["final_ranks"] = len(finals)
        deadline = time.monotonic() + LEAVE_S
        while _still_running(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        result["left_running"] = _still_running(seen)
        result["processes_watched"] = len(seen)
        if code != 0:
            result["log_tail"] = job.log.read_text()[-3000:]
    finally:
        job.kill()
    failures = sum(1 for t in trials if not t["ok"])
    result["failures"] = failures + (0 if result.get("exit_code") == 0 and result.get("final_params_equal")
                                     and not result.get("left_running") else 1)
    result["not_run"] = cycles - len(trials)
    return result


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


def _fmt(samples: list[float]) -> tuple[str, str, str]:
    if not samples:
        return "-", "-", "0"
    s = summarize(samples)
    return f"{s['median']:.2f}", f"{s['max']:.2f}", str(len(samples))


def _report(data: dict[str, Any]) -> str:
    machine, runs, torch_res = data["machine"], data["kill_runs"], data["torchrun"]
    headline = runs[0] if runs else {"trials": []}
    recovery = [t["recovery_s"] for t in headline["trials"] if "recovery_s" in t]
    gaps = [t["scale_up_gap_s"] for t in headline["trials"] if "scale_up_gap_s" in t]
    overhead = data["elastic_over_fixed"]
    loads = [t["load_1min"] for r in runs for t in r["trials"] if "load_1min" in t] + torch_res["load_1min"]
    rows = [
        ["hora: SIGKILL -> survivors' next step (s)", *_fmt(recovery), "<= 3 s"],
        ["torchrun --max-restarts: SIGKILL -> restarted workers' first step (s)", *_fmt(torch_res["recovery_s"]),
         "-"],
        ["hora: survivors' longest gap while a host joins (s)", *_fmt(gaps), "<= 1 s"],
        ["step time elastic / fixed, no events (ratio)", *_fmt(overhead), "<= 1.02"],
    ]
    kill_rows = []
    for r in runs:
        rec = [t["recovery_s"] for t in r["trials"] if "recovery_s" in t]
        gap = [t["scale_up_gap_s"] for t in r["trials"] if "scale_up_gap_s" in t]
        end = (f"exit {r.get('exit_code')}, final params {'equal' if r.get('final_params_equal') else 'DIFFER'} "
               f"on {r.get('final_ranks', 0)} ranks, {len(r.get('left_running', [])) or 'no'} process left")
        kill_rows.append([r["variant"], f"{len(r['trials'])} of {r['cycles']}", str(r["failures"]),
                          f"{_fmt(rec)[0]} / {_fmt(rec)[1]}", f"{_fmt(gap)[0]} / {_fmt(gap)[1]}", end])
    problems = [f"- {r['variant']}, failure {t['trial']}: {'; '.join(t['problems'])[:400]}"
                for r in runs for t in r["trials"] if not t["ok"]]
    md = [
        "# elastic_bench: recovery from a failed worker, scale-up, no-event overhead, failures in a row",
        "",
        f"One run, {machine['utc']}, commit {machine['git_commit']}, {machine['cpus']} CPUs, "
        f"load average (1 min) at the failures {min(loads, default=0):.1f}..{max(loads, default=0):.1f}.",
        "",
        markdown_table(["figure", "median", "max", "n", "target"], rows),
        "",
        f"hora's recovery and scale-up figures come from the \"{headline.get('variant', '-')}\" failures below. "
        f"torchrun failures: {'; '.join(torch_res['failures']) or 'none'}.",
        "",
        "## Every failure test many times in a row (target: 0 failures)",
        "",
        f"Each variant is one elastic job of 4 workers on one machine ({HOSTS}, --blacklist-cooldown-range 1 1) "
        "in which a worker fails again and again (rank 0 every other time): a SIGKILL, or an exception raised in "
        "the training loop. A failure counts as passed when the 3 survivors step in a world of 3 within "
        f"{RECOVER_S:g} s, the failed worker's process is gone within {LEAVE_S:g} s, the failed slot's new "
        "worker joins after the cooldown (a world of 4 again), and every rank of every world has the same "
        "parameters at every step (a hash recorded each step). At the end each job must exit 0 with equal final "
        "parameters on every rank and no process left (none of the agents and workers seen below its launcher); "
        "a job that does not counts as one more failure.",
        "",
        markdown_table(["variant", "failures run", "failed", "recovery median / max (s)",
                        "rejoin gap median / max (s)", "end of the job"], kill_rows),
        "",
        *(problems or ["No failure."]),
        "",
        "Setup: benchmarks/elastic_worker.py (hvd.elastic.run, TorchState, a commit every step, a 20 ms sleep "
        "per step). torchrun: --nnodes=1:2 --nproc-per-node=4 --max-restarts, c10d rendezvous, the same script "
        "(no state survives a restart). The overhead rows run 4 workers without sleep, elastic (-np 4 --min-np 4) "
        "and fixed (-np 4) alternately.",
        "",
    ]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10,
                   help="SIGKILLs (fixed -H) for the recovery and scale-up figures (default 10)")
    p.add_argument("--kill-runs", type=int, default=0,
                   help="run every failure variant (SIGKILL/raise x -H/discovery) this many times in a row "
                        "(the SIGKILL -H one at least --trials times); default 0: only --trials SIGKILLs")
    p.add_argument("--torchrun-trials", type=int, default=None, help="torchrun restarts (default: --trials)")
    p.add_argument("--steps", type=int, default=300, help="steps per no-event overhead run")
    p.add_argument("--pairs", type=int, default=6, help="fixed/elastic run pairs for the overhead (alternating ABBA)")
    p.add_argument("--skip-torchrun", action="store_true")
    add_output_flags(p, "2 failures of each kind, 1 torchrun restart, 60-step overhead runs, 1 pair")
    args = p.parse_args(argv)
    if args.quick:
        args.trials, args.kill_runs, args.torchrun_trials, args.steps, args.pairs = 2, 2, 1, 60, 1
    torchrun_trials = 0 if args.skip_torchrun else (args.trials if args.torchrun_trials is None
                                                    else args.torchrun_trials)
    variants = list(VARIANTS) if args.kill_runs else list(VARIANTS)[:1]
    data: dict[str, Any] = {"machine": machine_info(), "kill_runs": [], "torchrun": {
        "recovery_s": [], "load_1min": [], "failures": ["not run"]}, "step_time_fixed_s": [],
        "step_time_elastic_s": [], "elastic_over_fixed": []}

    def save() -> list[Path]:  # after every part: a run cut short still leaves its figures
        data["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        return write_results("elastic_bench", data, _report(data), out_dir=output_dir(args))

    with tempfile.TemporaryDirectory(prefix="elastic-bench-", ignore_cleanup_errors=True) as tmpdir:
        tmp = Path(tmpdir)
        # the figures first (the SIGKILL variant, the overhead, torchrun), then the other failure variants
        data["kill_runs"].append(kill_runs(variants[0], max(args.trials, args.kill_runs), tmp))
        save()
        for i in range(args.pairs):  # A B B A ...: a drift of the machine's load falls on both sides alike
            for elastic in ((False, True) if i % 2 == 0 else (True, False)):
                key = "step_time_elastic_s" if elastic else "step_time_fixed_s"
                data[key].append(step_time(elastic, args.steps, tmp, 2 * i + elastic))
            data["elastic_over_fixed"].append(data["step_time_elastic_s"][-1] / data["step_time_fixed_s"][-1])
            save()
        if torchrun_trials:
            data["torchrun"] = torchrun_kills(torchrun_trials, tmp)
            save()
        for name in variants[1:]:
            data["kill_runs"].append(kill_runs(name, args.kill_runs, tmp))
            save()
        paths = save()
    print(_report(data))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0 if all(r["failures"] == 0 and r["not_run"] == 0 for r in data["kill_runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
