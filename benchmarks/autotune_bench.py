"""Autotune on a shaped 1 Gbit link: does ``hora run --autotune`` find a setting at least as fast as the default,
on a model where the default is not the best?

Two simulated hosts (network namespaces whose cables tc shapes to ``--rate-mbit`` each way, as
benchmarks/shaped_links.py), one rank each, train a model of many small layers (``--layers`` Linear+Tanh of
``--width``) with DistributedOptimizer:

1. **tune**: one job with ``--autotune`` (``--autotune-log-file`` kept in the results): Horovod's warm-up,
   samples and Bayesian search over the bucket size and the fusion threshold;
2. **compare**: jobs with the default settings and with the settings autotune kept (given explicitly), alternated
   A B A B (the order rotated each cycle), ``--repeats`` of each; each job's figure is its median step time after
   ``--skip`` steps. The ratio tuned/default is taken per cycle; the median and spread of the ratios are reported,
   with the load average at each job.

Needs root, iproute2, openssh-server and the tbf qdisc (where missing it says why and writes nothing).

    python benchmarks/autotune_bench.py                 # ~15 min on 2 busy cores
    python benchmarks/autotune_bench.py --quick         # a smoke run

Writes benchmarks/results/autotune_bench.{json,md} and autotune_bench_log.csv (``--out`` to change the directory).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the cluster helpers are the package tests.cluster
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_flags, machine_info, markdown_table, output_dir  # noqa: E402
from tests.cluster import jobs, netns  # noqa: E402

log = logging.getLogger("autotune_bench")
WORKER = str(Path(__file__).resolve().parent / "autotune_worker.py")
_MB = 1024 * 1024


def _job(cluster: netns.Cluster, ns: argparse.Namespace, work: Path, name: str, flags: list[str],
         steps: int) -> dict[str, Any]:
    out = work / f"{name}.json"
    (work / name).mkdir(parents=True, exist_ok=True)
    hosts = ",".join(f"{h.addr}:1" for h in cluster.hosts[:2])
    load_before = os.getloadavg()[0]
    code, job = jobs.run_job(cluster, ["-np", "2", "-H", hosts, *jobs.hora_ssh_flags(cluster), *flags],
                             [sys.executable, WORKER, "--layers", str(ns.layers), "--width", str(ns.width),
                              "--batch", str(ns.batch), "--steps", str(steps), "--out", str(out)],
                             work / name, timeout=ns.job_timeout)
    if code != 0:
        raise RuntimeError(f"{name}: the job failed ({code}):\n{job.describe()}")
    record: dict[str, Any] = json.loads(out.read_text())
    record["load_avg"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    return record


def tune(cluster: netns.Cluster, ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One job under --autotune; the settings it kept (the log's last row)."""
    log_file = work / "autotune.csv"
    steps = (ns.warmup + ns.samples) * ns.steps_per_sample * 2 + 20  # room for the steps between samples
    record = _job(cluster, ns, work, "tune", [
        "--autotune", "--autotune-log-file", str(log_file), "--autotune-warmup-samples", str(ns.warmup),
        "--autotune-steps-per-sample", str(ns.steps_per_sample), "--autotune-bayes-opt-max-samples", str(ns.samples),
    ], steps)
    rows = list(csv.DictReader(log_file.open()))
    record["log"] = log_file.read_text()
    best = rows[-1]
    record["best"] = {"bucket_cap_mb": float(best["bucket_cap_mb"]),
                      "fusion_threshold_mb": float(best["tensor_fusion_threshold"]),
                      "hierarchical_allreduce": best["hierarchical_allreduce"] == "1", "score": float(best["score"])}
    if record["tuned_at"] is None:
        raise RuntimeError(f"autotune did not finish within {steps} steps; raise the job's steps")
    return record


def compare(cluster: netns.Cluster, ns: argparse.Namespace, work: Path, best: dict[str, Any]) -> dict[str, Any]:
    variants = {
        "default": [],
        "tuned": ["-x", f"HORA_BUCKET_CAP_MB={best['bucket_cap_mb']}",
                  "-x", f"HORA_FUSION_THRESHOLD={int(best['fusion_threshold_mb'] * _MB)}"],
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    names = list(variants)
    for i in range(ns.repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            record = _job(cluster, ns, work, f"{name}-{i}", variants[name], ns.steps)
            record["median_step_s"] = statistics.median(record["times"][ns.skip:])
            runs[name].append(record)
            log.info("%s #%d: median step %.3f s (load %s)", name, i, record["median_step_s"], record["load_avg"])
    ratios = [t["median_step_s"] / d["median_step_s"] for t, d in zip(runs["tuned"], runs["default"])]
    return {"runs": runs, "ratios": ratios}


def report(data: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "autotune_bench.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "autotune_bench_log.csv").write_text(data["tune"]["log"])
    tune_rec, cmp_rec = data["tune"], data["compare"]
    best = tune_rec["best"]
    ratios = cmp_rec["ratios"]
    rows = []
    for name in ("default", "tuned"):
        steps = [r["median_step_s"] for r in cmp_rec["runs"][name]]
        loads = [r["load_avg"][0] for r in cmp_rec["runs"][name]]
        rows.append([name, f"{statistics.median(steps):.3f}", f"{min(steps):.3f}-{max(steps):.3f}",
                     f"{min(loads):.1f}-{max(loads):.1f}"])
    md = [
        "# Autotune on a shaped link",
        "",
        f"2 hosts x 1 rank, cables shaped to {data['rate_mbit']:g} Mbit/s each way; model: {data['layers']} x "
        f"(Linear({data['width']}, {data['width']}) + Tanh), batch {data['batch']}, "
        f"{tune_rec['gradient_bytes'] / _MB:.1f} MB of gradients; DistributedOptimizer(SGD).",
        "",
        f"**Autotune** (warm-up {data['warmup']}, {data['steps_per_sample']} steps per sample, "
        f"{data['samples']} Bayesian samples) ended after step {tune_rec['tuned_at']} and kept bucket "
        f"{best['bucket_cap_mb']:g} MB, fusion threshold {best['fusion_threshold_mb']:g} MB (the defaults: 25 MB, "
        f"64 MB). Its log, in Horovod's columns: [autotune_bench_log.csv](autotune_bench_log.csv).",
        "",
        f"**Compared** ({data['repeats']} jobs each, alternated, {data['steps']} steps, median step after "
        f"{data['skip']}):",
        "",
        markdown_table(["settings", "median step (s)", "range over jobs", "load avg at start"], rows),
        "",
        f"tuned / default step time, per cycle: median **{statistics.median(ratios):.3f}** "
        f"(spread {min(ratios):.3f}-{max(ratios):.3f}); below 1 is faster.",
        "",
        f"Machine: {data['machine']}",
    ]
    (out / "autotune_bench.md").write_text("\n".join(md) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--layers", type=int, default=96)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps-per-sample", type=int, default=5)
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="steps left out of each compared job's median")
    p.add_argument("--job-timeout", type=float, default=900)
    add_output_flags(p, "a small model, few samples and jobs: a smoke run")
    ns = p.parse_args()
    out = output_dir(ns)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if ns.quick:
        ns.layers, ns.width, ns.samples, ns.repeats, ns.steps, ns.skip = 16, 128, 5, 2, 12, 2
    reason = netns.shaping_missing()
    if reason is not None:
        print(f"autotune_bench: skipped: {reason}")
        return 0
    data: dict[str, Any] = {"machine": machine_info(), **{k: getattr(ns, k) for k in (
        "rate_mbit", "layers", "width", "batch", "warmup", "steps_per_sample", "samples", "repeats", "steps", "skip")}}
    work = Path(tempfile.mkdtemp(prefix="hora-autotune-"))
    started = time.monotonic()
    with netns.Cluster.build(range(2, 4)) as cluster:
        cluster.shape(ns.rate_mbit)
        data["tune"] = tune(cluster, ns, work)
        log.info("autotune kept %s", data["tune"]["best"])
        data["compare"] = compare(cluster, ns, work, data["tune"]["best"])
    data["minutes"] = round((time.monotonic() - started) / 60, 1)
    report(data, out)
    print((out / "autotune_bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
