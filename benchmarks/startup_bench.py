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
(>= 5) with min and max, and the median of the per-pair hora/torchrun ratios.

    .venv/bin/python benchmarks/startup_bench.py --reps 5 [--no-cluster]     (root for the 3-host cases)
    .venv/bin/python benchmarks/startup_bench.py --quick                     (1 rep, localhost: out/bench-quick/)
Writes benchmarks/results/startup_bench.{json,md} (``--out`` to change the directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "startup_worker.py")
PY = sys.executable
HORA = str(Path(sys.executable).parent / "hora")
sys.path.insert(0, str(ROOT))  # the cluster helpers are the package tests.cluster


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
    return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def local_cases(np: int) -> dict[str, tuple[Starter, int]]:
    """hora and torchrun with ``np`` ranks on this machine."""
    return {
        "hora-local": (
            lambda out: [_popen([HORA, "run", "-np", str(np), "-H", f"localhost:{np}", PY, WORKER, "hora", str(out)])],
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


def summarize_all(results: dict[str, list[Sample]]) -> dict[str, Any]:
    """Per case: summaries of both metrics; per place: hora/torchrun ratios of the pairs run back to back."""
    table: dict[str, Any] = {}
    for name, samples in results.items():
        table[name] = {
            "first": common.summarize([s.first_s for s in samples]),
            "exit": common.summarize([s.exit_s for s in samples]),
        }
    for where in ("local", "3hosts"):
        hora, torch = results.get(f"hora-{where}"), results.get(f"torchrun-{where}")
        if hora and torch:
            table[f"ratio-{where}"] = {
                "first": common.ratio_summary([s.first_s for s in hora], [s.first_s for s in torch]),
                "exit": common.ratio_summary([s.exit_s for s in hora], [s.exit_s for s in torch]),
            }
    return table


def markdown(table: dict[str, Any], info: dict[str, Any], reps: int, np: int) -> str:
    """The results page: one row per case, then the ratios."""
    head = (
        f"# Startup: launch command -> first completed allreduce, hora vs torchrun\n\n"
        f"{info['utc']}, {info['cpu']} x{info['cpus']}, torch {info['torch']}, hora {info['hora']} "
        f"({info['git_commit']}); median of {reps} alternating samples (min-max). Localhost: {np} ranks; "
        "3 hosts: 2 ranks on each of node2..node4 (network namespaces, ssh from node2).\n\n"
    )
    rows = []
    for name, row in table.items():
        first, done = row["first"], row["exit"]
        unit = "x" if name.startswith("ratio") else " s"
        rows.append(
            [
                name,
                f"{first['median']:.2f}{unit} ({first['min']:.2f}-{first['max']:.2f})",
                f"{done['median']:.2f}{unit} ({done['min']:.2f}-{done['max']:.2f})",
            ]
        )
    return head + common.markdown_table(["case", "first allreduce", "launcher exit"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per case (median of these; >= 5)")
    parser.add_argument("--np", type=int, default=4, help="ranks for the localhost cases")
    parser.add_argument("--no-cluster", action="store_true", help="skip the 3-host cases")
    common.add_output_flags(parser, "1 repetition of the localhost cases with 2 ranks, no 3-host cases")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.np, args.no_cluster = 1, 2, True
    info = common.machine_info()
    print(f"startup benchmark: {args.reps} reps, torch {info['torch']}, {info['cpus']} cpus", flush=True)
    results = run_all(local_cases(args.np), args.reps)
    if not args.no_cluster:
        from tests.cluster import netns

        reason = netns.missing_requirements()
        if reason:
            print(f"3-host cases skipped: {reason}")
        else:
            with netns.Cluster.build((2, 3, 4)) as cluster:
                results.update(run_all(cluster_cases(cluster), args.reps))
    table = summarize_all(results)
    page = markdown(table, info, args.reps, args.np)
    print("\n" + page)
    data = {
        "machine": info,
        "reps": args.reps,
        "np": args.np,
        "summary": table,
        "samples": {name: [dataclasses.asdict(s) for s in samples] for name, samples in results.items()},
    }
    for path in common.write_results("startup_bench", data, page, out_dir=common.output_dir(args)):
        print(f"wrote {path}")
    return 0


def _torch_version() -> str:
    out = subprocess.run(
        [PY, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
