"""Startup benchmark (not a test): time from the launch command to the first completed allreduce.

Cases, alternated within each repetition (the order flips every repetition) so drift hits all alike:
  * ``hora-local``     ``hora run -np 4 -H localhost:4 python startup_worker.py hora``
  * ``torchrun-local`` ``python -m torch.distributed.run --standalone --nproc-per-node 4 ... torch``
  * ``hora-3hosts``    (root only) ``hora run -np 6 -H 10.78.0.2:2,10.78.0.3:2,10.78.0.4:2`` from node2, over ssh
    to the network-namespace hosts of tests/cluster
  * ``torchrun-3hosts`` (root only) one ``torchrun --nnodes 3 --nproc-per-node 2`` per host, c10d rendezvous
    on node2, all started at t0 (what a user does by hand, minus their typing)

"first allreduce" is the latest rank's ``time.time()`` right after its first allreduce returned (every host
shares this machine's clock); "exit" is when the launch command returned. Reports medians of ``--reps``
(>= 5) with min and max, and the hora/torchrun ratio of the medians.

    sudo .venv/bin/python benchmarks/startup_bench.py --reps 5 [--no-cluster] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "startup_worker.py")
PY = sys.executable
HORA = str(Path(sys.executable).parent / "hora")
sys.path.insert(0, str(ROOT / "tests" / "cluster"))


@dataclass(frozen=True)
class Sample:
    first_s: float  # launch -> the last rank's first allreduce returned
    exit_s: float  # launch -> the launch command returned


Starter = Callable[[Path], list[subprocess.Popen[str]]]


def measure(start: Starter, expected_ranks: int, timeout: float = 300) -> Sample:
    """Start one case, wait for it, read when each rank finished its first allreduce."""
    with tempfile.TemporaryDirectory(prefix="hora-startup-") as tmp:
        out = Path(tmp)
        t0 = time.time()
        procs = start(out)
        for proc in procs:
            stdout, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{stdout[-3000:]}")
        t_exit = time.time()
        stamps = [float(p.read_text()) for p in out.glob("first.*")]
        if len(stamps) != expected_ranks:
            raise RuntimeError(f"{len(stamps)} of {expected_ranks} ranks reported their first allreduce")
        return Sample(first_s=max(stamps) - t0, exit_s=t_exit - t0)


def _popen(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )


def local_cases(np: int) -> dict[str, tuple[Starter, int]]:
    """hora and torchrun with ``np`` ranks on this machine."""
    return {
        "hora-local": (
            lambda out: [
                _popen([HORA, "run", "-np", str(np), "-H", f"localhost:{np}", PY, WORKER, "hora", str(out)])
            ],
            np,
        ),
        "torchrun-local": (
            lambda out: [
                _popen(
                    [
                        PY,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        str(np),
                        WORKER,
                        "torch",
                        str(out),
                    ]
                )
            ],
            np,
        ),
    }


def cluster_cases(cluster: object, per_host: int = 2) -> dict[str, tuple[Starter, int]]:
    """hora over ssh from node2 to the three namespace hosts, and torchrun started on each host."""
    hosts = cluster.hosts  # type: ignore[attr-defined]
    login = hosts[0]
    spec = ",".join(f"{h.addr}:{per_host}" for h in hosts)
    np = per_host * len(hosts)

    def hora(out: Path) -> list[subprocess.Popen[str]]:
        cmd = [
            HORA,
            "run",
            "-np",
            str(np),
            "-H",
            spec,
            "--ssh-config-file",
            str(cluster.ssh_config),  # type: ignore[attr-defined]
            PY,
            WORKER,
            "hora",
            str(out),
        ]
        return [login.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)]

    def torchrun(out: Path) -> list[subprocess.Popen[str]]:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
        rdzv = [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{login.addr}:29400",
            "--rdzv-id",
            out.name,
            "--nnodes",
            str(len(hosts)),
            "--nproc-per-node",
            str(per_host),
        ]
        return [
            h.popen(
                [PY, "-m", "torch.distributed.run", *rdzv, WORKER, "torch", str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
            for h in hosts
        ]

    return {"hora-3hosts": (hora, np), "torchrun-3hosts": (torchrun, np)}


def run_all(cases: dict[str, tuple[Starter, int]], reps: int) -> dict[str, list[Sample]]:
    """Every case once per repetition, the order reversed on odd repetitions."""
    results: dict[str, list[Sample]] = {name: [] for name in cases}
    names = list(cases)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            start, ranks = cases[name]
            sample = measure(start, ranks)
            results[name].append(sample)
            print(
                f"  rep {rep + 1} {name:16s} first allreduce {sample.first_s:6.2f} s  exit {sample.exit_s:6.2f} s",
                flush=True,
            )
    return results


def summarize(results: dict[str, list[Sample]]) -> dict[str, dict[str, float]]:
    """Median, min, max per case and metric; ratios hora/torchrun of the medians."""
    table: dict[str, dict[str, float]] = {}
    for name, samples in results.items():
        firsts = [s.first_s for s in samples]
        exits = [s.exit_s for s in samples]
        table[name] = {
            "first_median": statistics.median(firsts),
            "first_min": min(firsts),
            "first_max": max(firsts),
            "exit_median": statistics.median(exits),
            "n": len(samples),
        }
    for where in ("local", "3hosts"):
        hora, torch = table.get(f"hora-{where}"), table.get(f"torchrun-{where}")
        if hora and torch:
            table[f"ratio-{where}"] = {
                "first_median": hora["first_median"] / torch["first_median"],
                "exit_median": hora["exit_median"] / torch["exit_median"],
            }
    return table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per case (median of these; >= 5)")
    parser.add_argument("--np", type=int, default=4, help="ranks for the localhost cases")
    parser.add_argument("--no-cluster", action="store_true", help="skip the 3-host cases")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    print(f"startup benchmark: {args.reps} reps, torch {_torch_version()}, {os.cpu_count()} cpus", flush=True)
    results = run_all(local_cases(args.np), args.reps)
    if not args.no_cluster:
        import netns

        reason = netns.missing_requirements()
        if reason:
            print(f"3-host cases skipped: {reason}")
        else:
            with netns.Cluster.build((2, 3, 4)) as cluster:
                results.update(run_all(cluster_cases(cluster), args.reps))
    table = summarize(results)
    print(f"\n{'case':18s} {'first allreduce median (min-max)':34s} exit median")
    for name, row in table.items():
        if name.startswith("ratio"):
            print(f"{name:18s} {row['first_median']:.2f}x{'':29s} {row['exit_median']:.2f}x")
        else:
            spread = f"{row['first_median']:.2f} s ({row['first_min']:.2f}-{row['first_max']:.2f})"
            print(f"{name:18s} {spread:34s} {row['exit_median']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


def _torch_version() -> str:
    out = subprocess.run(
        [PY, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
