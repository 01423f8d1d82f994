"""hora where the wire is the limit: simulated hosts (network namespaces, veth, a bridge) whose cables are
shaped with tc's token bucket filter to ``--rate-mbit`` each way, jobs started by ``hora run`` over ssh as on
a real cluster (tests/cluster/netns.py builds the hosts; this script only adds the shaping and the jobs).

Measured, each figure a ratio from one run that alternates the variants, rotating the order every cycle:

  sweep         ``hora bench allreduce`` on 2 hosts x 1 rank: busbw against the line rate; the planner's fit
  sweep16       the same with ``--compression fp16``: the planner's 16-bit wire (compression predictions)
  ps            hora's ring allreduce against a parameter server, 2, 4 and 8 single-rank hosts, ~100 MB
  compression   hvd.allreduce (out-of-place, Average) fp16 and bf16 against none, 2 hosts, ~100 MB
  wire16        raw 16-bit allreduce (Gloo's sum) against benchmarks/wire16.py (float32 sum), and float32
  gradsync      DistributedOptimizer steps with compression none/fp16/bf16, and the step without sync
  optimizer     DistributedOptimizer step against DDP's (and with one bucket, and no sync), 2 hosts, wide-mlp
  hierarchical  hierarchical against flat allreduce, 3 hosts x 2 ranks, large sizes
  synthetic     benchmarks/pytorch_synthetic_benchmark.py (Horovod's example's behaviour) on 2 shaped hosts
                and on one host over loopback, the two jobs alternated

The planner, fitted on the 2-host sweeps alone (plus the CPU rates they time), predicts every other
configuration; the report puts its prediction beside each measurement, and every part's load average.
Needs root, iproute2, openssh-server and the kernel's tbf qdisc: where
they are missing the script says why and writes nothing (it never fakes a link).

    python benchmarks/shaped_links.py                      # everything, 1 Gbit links (~30 min on 2 busy cores)
    python benchmarks/shaped_links.py --only ps,sweep      # a part
    python benchmarks/shaped_links.py --quick              # small sizes, 200 Mbit: a smoke run

Writes benchmarks/results/shaped_links.{json,md,png} (``--out`` to change the directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the cluster helpers are the package tests.cluster
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_info, markdown_table, ratio_summary, summarize, write_results  # noqa: E402
from tests.cluster import jobs, netns  # noqa: E402

from hora.bench import planner  # noqa: E402

log = logging.getLogger("shaped_links")
WORKER = str(Path(__file__).resolve().parent / "shaped_worker.py")
SYNTHETIC = str(Path(__file__).resolve().parent / "pytorch_synthetic_benchmark.py")
PARTS = ("sweep", "sweep16", "ps", "compression", "wire16", "gradsync", "optimizer", "hierarchical", "synthetic")


def _hosts_flag(cluster: netns.Cluster, count: int, slots: int) -> list[str]:
    hosts = ",".join(f"{h.addr}:{slots}" for h in cluster.hosts[:count])
    return ["-np", str(count * slots), "-H", hosts, *jobs.hora_ssh_flags(cluster)]


def _job(cluster: netns.Cluster, flags: list[str], command: list[str], work: Path, timeout: float) -> str:
    work.mkdir(parents=True, exist_ok=True)
    code, job = jobs.run_job(cluster, flags, command, work, timeout=timeout)
    if code != 0:
        raise RuntimeError(f"job failed ({code}):\n{job.describe()}")
    return job.stdout


def _worker(cluster: netns.Cluster, hosts: int, slots: int, mode: str, work: Path, args: list[str],
            env: list[str] | None = None, timeout: float = 400, tag: str = "") -> dict[str, Any]:
    out = work / f"{mode}{tag}-{hosts}x{slots}.json"
    flags = _hosts_flag(cluster, hosts, slots) + [x for kv in (env or []) for x in ("-x", kv)]
    log.info("%s on %d host(s) x %d", mode, hosts, slots)
    before = os.getloadavg()[0]
    _job(cluster, flags, [sys.executable, WORKER, mode, "--out", str(out), *args], work / f"{mode}{tag}{hosts}",
         timeout)
    record: dict[str, Any] = json.loads(out.read_text())
    record["load_avg"] = [round(before, 1), round(os.getloadavg()[0], 1)]  # 1-minute, at start and end
    out.write_text(json.dumps(record, indent=1) + "\n")  # --from-work reads it back
    return record


def run_sweep(cluster: netns.Cluster, ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "sweep.json"
    flags = _hosts_flag(cluster, 2, 1)
    before = os.getloadavg()[0]
    _job(cluster, flags, [str(Path(sys.executable).parent / "hora"), "bench", "allreduce", "--sizes", ns.sweep_sizes,
                          "--repeats", str(ns.repeats), "--json", str(out)], work / "sweep", 400)
    record: dict[str, Any] = json.loads(out.read_text())
    record["load_avg"] = [round(before, 1), round(os.getloadavg()[0], 1)]
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def run_sweep16(cluster: netns.Cluster, ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``hora bench allreduce --compression fp16`` on 2 hosts x 1 rank: the planner's 16-bit wire."""
    out = work / "sweep16.json"
    before = os.getloadavg()[0]
    _job(cluster, _hosts_flag(cluster, 2, 1),
         [str(Path(sys.executable).parent / "hora"), "bench", "allreduce", "--sizes", ns.sweep16_sizes, "--compression",
          "fp16", "--repeats", str(ns.repeats), "--no-links", "--json", str(out)], work / "sweep16", 400)
    record: dict[str, Any] = json.loads(out.read_text())
    record["load_avg"] = [round(before, 1), round(os.getloadavg()[0], 1)]
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def run_synthetic(cluster: netns.Cluster, ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The synthetic benchmark on 2 shaped hosts and on one host over loopback, the jobs alternated."""
    args = ["--model", ns.synthetic_model, "--batch-size", str(ns.synthetic_batch), "--num-warmup-batches", "1",
            "--num-batches-per-iter", "2", "--num-iters", "3", "--image-size", str(ns.synthetic_image)]
    command = [sys.executable, SYNTHETIC, *args]
    layouts = {"shaped_2_hosts": _hosts_flag(cluster, 2, 1),
               "loopback_1_host": ["-np", "2", "-H", f"{cluster.hosts[0].addr}:2", *jobs.hora_ssh_flags(cluster)]}
    samples: dict[str, list[float]] = {k: [] for k in layouts}
    outputs: dict[str, str] = {}
    names = list(layouts)
    for i in range(ns.synthetic_repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            text = _job(cluster, layouts[name], command, work / f"synthetic-{name}-{i}", 600)
            outputs[name] = text
            samples[name].append(_total_img_s(text))
    return {"args": args, "samples": samples, "last_output": outputs}


def _total_img_s(text: str) -> float:
    for line in text.splitlines():
        if "Total img/sec on" in line:
            return float(line.split(":")[-1].split("+-")[0])
    raise RuntimeError(f"no 'Total img/sec' line in the benchmark's output:\n{text[-2000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}")
    p.add_argument("--bytes", type=int, default=100 * 2**20, help="gradient set size (default 100 MB)")
    p.add_argument("--hier-bytes", type=int, default=128 * 2**20, help="hierarchical: message size")
    p.add_argument("--ps-hosts", default="2,4,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep-sizes", default="256KB..64MB")
    p.add_argument("--sweep16-sizes", default="1MB..64MB", help="sizes of the fp16 sweep (the 16-bit wire's fit)")
    p.add_argument("--synthetic-model", default="resnet50")
    p.add_argument("--synthetic-batch", type=int, default=4)
    p.add_argument("--synthetic-image", type=int, default=64)
    p.add_argument("--synthetic-repeats", type=int, default=2)
    p.add_argument("--opt-image", type=int, default=32)
    p.add_argument("--opt-model", default="wide-mlp", help="optimizer: the model (default wide-mlp: ~100 MB of "
                   "gradients, little compute, so the wire is the limit)")
    p.add_argument("--opt-optimizers", default="sgd,momentum,adam",
                   help="optimizer: the torch optimizers to run it with (sgd, momentum, adam)")
    p.add_argument("--name", default="shaped_links", help="results file name (without extension)")
    p.add_argument("--quick", action="store_true", help="200 Mbit, small sizes, few repeats: a smoke run")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--from-work", type=Path, metavar="DIR",
                   help="no measuring: rebuild the report from the work directory (hora-shaped-*) of a run that "
                        "was stopped early (the parts it finished, the synthetic jobs it completed)")
    p.add_argument("--from-json", type=Path, metavar="PATH", help="no measuring: redraw the report of a record")
    ns = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if ns.from_work is not None:
        return _report(from_work(ns.from_work, ns), ns)
    if ns.from_json is not None:
        return _report(json.loads(ns.from_json.read_text()), ns)
    if ns.quick:
        ns.rate_mbit, ns.bytes, ns.hier_bytes, ns.repeats = 200.0, 4 * 2**20, 8 * 2**20, 2
        ns.ps_hosts, ns.sweep_sizes, ns.synthetic_model, ns.synthetic_repeats = "2,3", "64KB..4MB", "mlp", 1
        ns.sweep16_sizes = "256KB..4MB"
    reason = netns.shaping_missing()
    if reason is not None:
        print(f"shaped_links: skipped: {reason}")
        return 0
    parts = [x for x in ns.only.split(",") if x]
    ps_hosts = [int(x) for x in ns.ps_hosts.split(",")]
    n_hosts = max([2] + (ps_hosts if "ps" in parts else []) + ([3] if "hierarchical" in parts else []))
    data: dict[str, Any] = {"machine": machine_info(), "rate_mbit": ns.rate_mbit, "bytes": ns.bytes,
                            "repeats": ns.repeats, "parts": {}}
    work = Path(tempfile.mkdtemp(prefix="hora-shaped-"))
    started = time.monotonic()
    with netns.Cluster.build(range(2, 2 + n_hosts)) as cluster:
        cluster.shape(ns.rate_mbit)
        log.info("%d hosts, every cable shaped to %g Mbit/s each way", n_hosts, ns.rate_mbit)
        res = data["parts"]
        if "sweep" in parts:
            res["sweep"] = run_sweep(cluster, ns, work)
        if "sweep16" in parts:
            res["sweep16"] = run_sweep16(cluster, ns, work)
        if "compression" in parts:
            res["compression"] = _worker(cluster, 2, 1, "compression", work,
                                         ["--bytes", str(ns.bytes), "--repeats", str(ns.repeats)])
        if "gradsync" in parts:
            res["gradsync"] = _worker(cluster, 2, 1, "gradsync", work,
                                      ["--model", "mlp" if ns.quick else ns.opt_model, "--image-size",
                                       str(ns.opt_image), "--repeats", str(ns.repeats)])
        if "optimizer" in parts:
            for name in ns.opt_optimizers.split(","):
                tag = "" if name == "sgd" else f"_{name}"
                res[f"optimizer{tag}"] = _worker(
                    cluster, 2, 1, "optimizer", work,
                    ["--model", "mlp" if ns.quick else ns.opt_model, "--image-size", str(ns.opt_image),
                     "--repeats", str(ns.repeats), "--optimizer", name, *(["--one-bucket"] if name == "sgd" else [])],
                    tag=tag)
        if "ps" in parts:
            res["ps"] = {str(h): _worker(cluster, h, 1, "ps", work, ["--bytes", str(ns.bytes),
                                                                      "--repeats", str(ns.repeats)])
                         for h in ps_hosts}
        if "wire16" in parts:
            res["wire16"] = _worker(cluster, 2, 1, "wire16", work,
                                    ["--bytes", str(ns.bytes), "--repeats", str(ns.repeats)])
        if "hierarchical" in parts:
            res["hierarchical"] = _worker(cluster, 3, 2, "hierarchical", work,
                                          ["--bytes", str(ns.hier_bytes), "--repeats", str(ns.repeats)],
                                          env=["HOROVOD_HIERARCHICAL_ALLREDUCE=1"])
        if "synthetic" in parts:
            res["synthetic"] = run_synthetic(cluster, ns, work)
    data["wall_s"] = time.monotonic() - started
    _report(data, ns)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


def _report(data: dict[str, Any], ns: argparse.Namespace) -> int:
    report = analyse(data)
    data["analysis"] = report["figures"]
    suffix = "_quick" if ns.quick else ""
    for path in write_results(f"{ns.name}{suffix}", data, report["markdown"], plot=report["plot"], out_dir=ns.out):
        print(path)
    print(report["markdown"])
    return 0


def from_work(work: Path, ns: argparse.Namespace) -> dict[str, Any]:
    """The record of a run stopped early, from what its work directory holds."""
    parts: dict[str, Any] = {}
    for name in ("sweep", "sweep16"):
        if (work / f"{name}.json").exists():
            parts[name] = json.loads((work / f"{name}.json").read_text())
    ps = {p.stem.split("-")[1].split("x")[0]: json.loads(p.read_text()) for p in sorted(work.glob("ps-*x1.json"))}
    if ps:
        parts["ps"] = dict(sorted(ps.items(), key=lambda kv: int(kv[0])))
    for mode, pattern in (("compression", "compression-*.json"), ("wire16", "wire16-*.json"),
                          ("gradsync", "gradsync-*.json"), ("optimizer", "optimizer-*.json"),
                          ("hierarchical", "hierarchical-*.json")):
        found = sorted(work.glob(pattern))
        if found:
            parts[mode] = json.loads(found[0].read_text())
    for path in sorted(work.glob("optimizer_*-2x1.json")):  # the optimizer part with momentum, adam
        parts[path.name.removesuffix("-2x1.json")] = json.loads(path.read_text())
    synthetic: dict[str, list[float]] = {}
    for d in sorted(work.glob("synthetic-*-*")):
        name, _, _ = d.name.removeprefix("synthetic-").rpartition("-")
        try:
            synthetic.setdefault(name, []).append(_total_img_s((d / "launcher.stdout").read_text()))
        except (OSError, RuntimeError):
            continue  # a job that was stopped
    if len(synthetic) == 2:  # both layouts: the cycles every layout completed
        done = min(len(v) for v in synthetic.values())
        synthetic = {k: v[:done] for k, v in synthetic.items()}
        parts["synthetic"] = {"args": ["--model", ns.synthetic_model, "--batch-size", str(ns.synthetic_batch),
                                       "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "3",
                                       "--image-size", str(ns.synthetic_image)], "samples": synthetic}
    return {"machine": machine_info(), "rate_mbit": ns.rate_mbit, "bytes": ns.bytes, "repeats": ns.repeats,
            "parts": parts, "rebuilt_from": str(work)}


def _ratio(num: list[float], den: list[float]) -> dict[str, float]:
    return ratio_summary(num, den)


_OPT_NAMES = {"sgd": "SGD", "momentum": "SGD with momentum 0.9", "adam": "Adam"}
_OPT_VARIANTS = {"ddp": "DDP", "hora": "hora DistributedOptimizer (25 MB buckets; update overlaps the wire)",
                 "hora_sync_first": "hora, update after every bucket is back (`synchronize()`, then `step()`)",
                 "hora_one_bucket": "hora, one bucket (num_groups=1)", "local": "no sync (compute)"}


def _optimizer_section(key: str, rec: dict[str, Any], md: list[str], figures: dict[str, Any]) -> None:
    """The optimizer part with one torch optimizer: its table, and its figures under ``key``."""
    smp = rec["samples"]
    ratio = _ratio(smp["hora"], smp["ddp"])
    figures[key] = {"hora_over_ddp": ratio, "load_avg": rec.get("load_avg")}
    for variant in ("hora_one_bucket", "hora_sync_first"):
        if variant in smp:
            figures[key][f"{variant.removeprefix('hora_')}_over_ddp"] = _ratio(smp[variant], smp["ddp"])
    inputs = "" if rec["model"].endswith("mlp") else f" of {rec['image_size']}px images"
    optimizer = _OPT_NAMES.get(rec.get("optimizer", "sgd"), rec.get("optimizer", "sgd"))
    md.append(f"## DistributedOptimizer against DDP, {optimizer}, 2 hosts, {rec['model']} "
              f"({_mb(rec['gradient_bytes'])} of gradients), batch {rec['batch_size']}{inputs}{_load(rec)}\n")
    busy = {k: statistics.median(v) for k, v in rec.get("cpu_busy", {}).items() if v}
    md.append(markdown_table(["variant", "median step", "time / DDP's", "cores busy"],
                             [[_OPT_VARIANTS.get(k, k), f"{statistics.median(v):.3f} s",
                               "" if k == "ddp" else f"{_ratio(v, smp['ddp'])['median']:.2f}x "
                               f"({_ratio(v, smp['ddp'])['spread']:.0%})",
                               f"{busy[k]:.0%}" if k in busy else "-"] for k, v in smp.items()]))


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Figures, the planner's predictions beside them, a Markdown report and a plot."""
    parts, rate = data["parts"], data["rate_mbit"]
    line_Bps = rate * 1e6 / 8
    figures: dict[str, Any] = {}
    md = [f"# hora on shaped links: {rate:g} Mbit/s per host cable, each way\n",
          "Simulated hosts (network namespaces + veth + bridge, tc tbf on both ends of every cable), jobs started "
          "by `hora run` over ssh. Every figure is a per-cycle ratio of variants alternated in one run (rotating "
          f"order), median with spread; {data['repeats']} cycles. The machine (2 cores) was shared with other "
          f"work while this ran (load average {_machine_load(data)}).\n"]
    if "note" in data:
        md.append(f"{data['note']}\n")
    if "rebuilt_from" in data:
        md.append("This report was rebuilt (`--from-work`) from the parts a run finished before it was stopped; "
                  "the synthetic benchmark's figures are the jobs that completed.\n")
    plan = None
    if "sweep" in parts:
        sweep = parts["sweep"]
        plan = planner.fit_sweep(sweep, min_bytes=1 << 20)
        rows = sweep["rows"]
        big = rows[-1]
        figures["busbw_fraction_of_line"] = {"raw": big["raw"]["busbw_GBps"] * 1e9 / line_Bps,
                                             "hora": big["hora"]["busbw_GBps"] * 1e9 / line_Bps,
                                             "size": big["size"]}
        md.append(f"## allreduce sweep, 2 hosts x 1 rank (`hora bench allreduce`){_load(sweep)}\n")
        md.append(markdown_table(
            ["size", "raw busbw MB/s", "hora busbw MB/s", "hora busbw / line rate", "hora speed vs raw"],
            [[_mb(r["size"]), f"{r['raw']['busbw_GBps'] * 1e3:.1f}", f"{r['hora']['busbw_GBps'] * 1e3:.1f}",
              f"{r['hora']['busbw_GBps'] * 1e9 / line_Bps:.2f}",
              f"{r['speed_vs_raw']['median']:.2f}x ({r['speed_vs_raw']['spread']:.0%})"] for r in rows]))
        assert plan.inter is not None
        md.append(f"\nPlanner fit (sizes >= 1 MB): alpha {plan.inter.alpha * 1e6:.0f} µs, bandwidth "
                  f"{plan.inter.gbps * 1e3:.0f} Mbit/s (line {rate:g}), worst fit error "
                  f"{plan.inter.max_rel_err:.1%}.\n")
        figures["fit"] = planner.as_dict(plan)
    validation: list[list[Any]] = []
    plan16 = None
    if "sweep16" in parts:
        plan16 = planner.fit_sweep(parts["sweep16"], min_bytes=1 << 20)
        figures["fit16"] = planner.as_dict(plan16)
        if plan16.wire16 is not None:
            md.append(f"Planner fit of the fp16 sweep (`hora bench allreduce --compression fp16`, sizes >= 1 MB"
                      f"{_load(parts['sweep16'])}): 16-bit wire alpha {plan16.wire16.alpha * 1e6:.0f} µs, "
                      f"{plan16.wire16.gbps * 1e3:.0f} Mbit/s of 16-bit data, worst fit error "
                      f"{plan16.wire16.max_rel_err:.1%}.\n")
    if "ps" in parts:
        md.append("## ring allreduce against a parameter server, single-rank hosts\n")
        rows_md = []
        figures["ps"] = {}
        for hosts, rec in parts["ps"].items():
            h = int(hosts)
            ratio = _ratio(rec["samples"]["ps"], rec["samples"]["ring"])
            ring_s, ps_s = (statistics.median(rec["samples"][k]) for k in ("ring", "ps"))
            model_ratio = None
            if plan is not None:
                pr, pp = plan.allreduce(rec["bytes"], h), plan.parameter_server(rec["bytes"], h, rec["chunks"])
                model_ratio = pp / pr
                if h != 2:
                    validation.append([f"ring allreduce, {h} hosts, {_mb(rec['bytes'])}", pr, ring_s])
                validation.append([f"parameter server, {h} hosts, {_mb(rec['bytes'])}", pp, ps_s])
            busy = {k: statistics.median(v) for k, v in rec.get("cpu_busy", {}).items() if v}
            figures["ps"][hosts] = {"ratio": ratio, "model_ratio": model_ratio, "ring_s": ring_s, "ps_s": ps_s,
                                    "cpu_busy": busy or None}
            load = rec.get("load_avg")
            rows_md.append([h, f"{ring_s:.2f} s", f"{ps_s:.2f} s", f"{ratio['median']:.2f}x ({ratio['spread']:.0%})",
                            f"{model_ratio:.2f}x" if model_ratio else "-", "3.2x (8 nodes)" if h == 8 else "",
                            f"{busy['ring']:.0%} / {busy['ps']:.0%}" if busy else "-",
                            f"{load[0]:g} -> {load[1]:g}" if load else "-"])
        md.append(markdown_table(["hosts", "ring (median)", "parameter server (median)",
                                  "ring speed-up (measured)", "model", "often quoted",
                                  "cores busy: ring / server", "load average"], rows_md))
        md.append("\nThe bandwidth model: the server's cable carries (N-1) S each way against the ring's 2(N-1)/N S "
                  "per cable, N/2 times the bytes; chunking overlaps the server's receiving and sending. "
                  "*Cores busy*: the share of the machine's cores (all the simulated hosts share them) that were "
                  "busy while each variant ran, median over the cycles (/proc/stat); near 100% the CPU, not the "
                  "cables, sets the time.\n")
    if "compression" in parts:
        rec = parts["compression"]
        smp = rec["samples"]
        busy = {k: statistics.median(v) for k, v in rec.get("cpu_busy", {}).items() if v}
        fp16 = _ratio(smp["none"], smp["fp16"])
        bf16 = _ratio(smp["none"], smp["bf16"])
        figures["compression"] = {"fp16_speedup": fp16, "bf16_speedup": bf16, "load_avg": rec.get("load_avg"),
                                  "cpu_busy": busy or None}
        md.append(f"## compression, 2 hosts, `hvd.allreduce` (out-of-place, Average) of {_mb(rec['bytes'])}"
                  f"{_load(rec)}\n")
        md.append(markdown_table(["variant", "median time", "speed-up against none", "cores busy"],
                                 [[k, f"{statistics.median(smp[k]):.3f} s",
                                   "1.00x" if k == "none" else f"{_ratio(smp['none'], smp[k])['median']:.2f}x "
                                   f"({_ratio(smp['none'], smp[k])['spread']:.0%})",
                                   f"{busy[k]:.0%}" if k in busy else "-"] for k in ("none", "fp16", "bf16")]))
        if plan is not None or plan16 is not None:
            for name in ("none", "fp16", "bf16"):
                by = plan16 if plan16 is not None else plan
                assert by is not None
                fit = " (fp16 sweep's fit)" if by is plan16 else ""
                validation.append([f"hvd.allreduce {name}, Average, 2 hosts, {_mb(rec['bytes'])}{fit}",
                                   by.hora_allreduce(rec["bytes"], 2, compression=name, call="out_of_place",
                                                     average=True),
                                   statistics.median(rec["samples"][name]),
                                   by.allreduce(rec["bytes"] / (1 if name == "none" else 2), 2)])
    if "wire16" in parts:
        rec = parts["wire16"]
        smp = rec["samples"]
        figures["wire16"] = {k: _ratio(smp["fp32"], smp[k]) for k in smp if k != "fp32"}
        figures["wire16"]["load_avg"] = rec.get("load_avg")
        md.append(f"## where a 16-bit allreduce's time goes: raw in-place allreduce of {_mb(rec['bytes'])} "
                  f"(as float32), 2 hosts{_load(rec)}\n")
        md.append(markdown_table(["variant", "median time", "speed-up against float32"],
                                 [[k, f"{statistics.median(v):.3f} s",
                                   "1.00x" if k == "fp32" else f"{figures['wire16'][k]['median']:.2f}x "
                                   f"({figures['wire16'][k]['spread']:.0%})"] for k, v in smp.items()]))
        md.append("\n`*_gloo_sum`: `dist.all_reduce` of the 16-bit tensor (Gloo sums in 16 bits); `*_wire16`: "
                  "benchmarks/wire16.py (alltoall of 16-bit chunks, float32 sum, allgather of 16-bit).\n")
    if "gradsync" in parts:
        rec = parts["gradsync"]
        smp = rec["samples"]
        sync = {k: [t - c for t, c in zip(smp[k], smp["local"])] for k in ("none", "fp16", "bf16")}
        figures["gradsync"] = {"step": {k: _ratio(smp["none"], smp[k]) for k in ("fp16", "bf16")},
                               "sync": {k: _ratio(sync["none"], sync[k]) for k in ("fp16", "bf16")},
                               "load_avg": rec.get("load_avg")}
        md.append(f"## gradient sync in training: DistributedOptimizer, 2 hosts, {rec['model']} "
                  f"({_mb(rec['gradient_bytes'])} of gradients){_load(rec)}\n")
        gbusy = {k: statistics.median(v) for k, v in rec.get("cpu_busy", {}).items() if v}
        md.append(markdown_table(
            ["variant", "median step", "step speed-up against none", "sync (step - no-sync step), median",
             "sync speed-up against none", "cores busy"],
            [[k, f"{statistics.median(smp[k]):.3f} s",
              "" if k in ("none", "local") else f"{figures['gradsync']['step'][k]['median']:.2f}x "
              f"({figures['gradsync']['step'][k]['spread']:.0%})",
              f"{statistics.median(sync[k]):.3f} s" if k in sync else "-",
              "" if k in ("none", "local") else f"{figures['gradsync']['sync'][k]['median']:.2f}x "
              f"({figures['gradsync']['sync'][k]['spread']:.0%})",
              f"{gbusy[k]:.0%}" if k in gbusy else "-"] for k in ("none", "fp16", "bf16", "local")]))
        md.append("\n`local`: the same step with a plain optimizer and no sync (the compute); sync = step - local "
                  "per cycle.\n")
    for key in [k for k in parts if k.startswith("optimizer")]:
        _optimizer_section(key, parts[key], md, figures)
    if "hierarchical" in parts:
        rec = parts["hierarchical"]
        ratio = _ratio(rec["samples"]["flat"], rec["samples"]["hierarchical"])
        flat_over = {k: _ratio(rec["samples"]["flat"], v) for k, v in rec["samples"].items()}
        figures["hierarchical"] = {"speedup": ratio, "load_avg": rec.get("load_avg"), "way": rec.get("way"),
                                   "flat_over": flat_over}
        md.append(f"## hierarchical against flat allreduce, 3 hosts x 2 ranks, {_mb(rec['bytes'])}{_load(rec)}\n")
        model = ""
        if plan is not None:
            flat_p = plan.allreduce(rec["bytes"], 3, 2)
            validation.append([f"flat ring, 3 hosts x 2, {_mb(rec['bytes'])}", flat_p,
                               statistics.median(rec["samples"]["flat"])])
            model = (f"; the bandwidth bound is {(10 / 6) / (4 / 3):.2f}x: per host cable the flat ring on 6 "
                     "ranks carries 2(6-1)/6 S = 1.67 S each way, the hierarchy 2(3-1)/3 S = 1.33 S")
        names = {"flat": "flat ring", "hierarchical": f"hierarchical ({rec.get('way', 'leader')} way)",
                 "shard": "hierarchical, shard way (reduce-scatter, each local rank's ring, allgather)",
                 "leader": "hierarchical, leader way (reduce, leaders' ring, broadcast)",
                 "raw_ring": "reference: torch.distributed's ring on the 6 ranks (no hora)",
                 "raw_leaders": "reference: the 3 leaders' ring alone (no hora, no intra-host step)"}
        busy = {k: statistics.median(v) for k, v in rec.get("cpu_busy", {}).items()}
        rows = [[names.get(k, k), f"{statistics.median(v):.3f} s",
                 "1.00x" if k == "flat" else f"{flat_over[k]['median']:.2f}x ({flat_over[k]['spread']:.0%})",
                 f"{busy[k]:.0%}" if k in busy else "-"] for k, v in rec["samples"].items()]
        md.append(markdown_table(["variant", "median time", "speed-up", "cores busy"], rows))
        md.append(f"\nHierarchical speed-up {ratio['median']:.2f}x{model}.\n")
    if "synthetic" in parts:
        rec = parts["synthetic"]
        ratio = _ratio(rec["samples"]["shaped_2_hosts"], rec["samples"]["loopback_1_host"])
        figures["synthetic"] = {"shaped_over_loopback": ratio,
                                "img_s": {k: summarize(v) for k, v in rec["samples"].items()}}
        md.append("## the synthetic benchmark (Horovod's example's behaviour) under `hora run`\n")
        md.append(f"`{' '.join(rec['args'])}`, 2 ranks\n\n")
        md.append(markdown_table(["layout", "total img/s (median)", "against loopback"],
                                 [[k, f"{statistics.median(v):.2f}",
                                   f"{_ratio(v, rec['samples']['loopback_1_host'])['median']:.2f}x"]
                                  for k, v in rec["samples"].items()]))
    if validation:
        rows_v = [(v[0], v[1], v[2], v[3] if len(v) > 3 else v[1]) for v in validation]
        errs = [abs(p - m) / m for _, p, m, _ in rows_v]
        figures["planner_validation"] = [{"config": c, "predicted_s": p, "measured_s": m, "error": abs(p - m) / m,
                                          "wire_only_s": w, "wire_only_error": abs(w - m) / m}
                                         for c, p, m, w in rows_v]
        md.append("## the planner on configurations it was not fitted on (fit: the 2-host sweep)\n")
        md.append("The prediction is the alpha-beta wire time plus, for hvd.allreduce, the CPU passes hora adds "
                  "(copies, casts, the division), timed by the sweep on each rank (`hora.bench.cpu`); the "
                  "wire-only column is the prediction without them.\n")
        md.append(markdown_table(["configuration", "predicted", "measured", "error", "wire only (error)"],
                                 [[c, f"{p:.3f} s", f"{m:.3f} s", f"{abs(p - m) / m:.1%}",
                                   f"{w:.3f} s ({abs(w - m) / m:.0%})"] for c, p, m, w in rows_v]))
        md.append(f"\nWorst error {max(errs):.1%}, median {statistics.median(errs):.1%}.\n")
    loads = {rec.get("load_avg_source") for rec in parts.values() if isinstance(rec, dict)} - {None}
    if loads:
        md.append(f"\nLoad averages of this record: {', '.join(sorted(loads))}.\n")

    def plot(fig: Any) -> None:
        fig.set_size_inches(14, 4.8)
        ax = fig.add_subplot(1, 3, 1)
        if "ps" in figures:
            hs = sorted(int(h) for h in figures["ps"])
            ax.plot(hs, [figures["ps"][str(h)]["ratio"]["median"] for h in hs], "o-", label="measured")
            if all(figures["ps"][str(h)]["model_ratio"] for h in hs):
                ax.plot(hs, [figures["ps"][str(h)]["model_ratio"] for h in hs], "s--", label="alpha-beta model")
            ax.axhline(3.2, color="grey", linestyle=":", label="often quoted: 3.2x (8 nodes)")
            ax.set_xlabel("single-rank hosts")
            ax.set_ylabel("ring speed-up over parameter server")
            ax.legend(fontsize=8)
            ax.grid(True, alpha=0.3)
        else:
            ax.axis("off")
        ax1 = fig.add_subplot(1, 3, 2)
        bars: dict[str, float] = {}
        if "compression" in figures:
            bars["fp16 allreduce"] = figures["compression"]["fp16_speedup"]["median"]
            bars["bf16 allreduce"] = figures["compression"]["bf16_speedup"]["median"]
        if "gradsync" in figures:
            bars["fp16 DO sync"] = figures["gradsync"]["sync"]["fp16"]["median"]
            bars["bf16 DO sync"] = figures["gradsync"]["sync"]["bf16"]["median"]
        for key in [k for k in figures if k.startswith("optimizer")]:
            label = key.removeprefix("optimizer").removeprefix("_") or "sgd"
            bars[f"DDP / hora step ({label})"] = 1 / figures[key]["hora_over_ddp"]["median"]
        if "hierarchical" in figures:
            bars["hierarchical 3x2"] = figures["hierarchical"]["speedup"]["median"]
        if bars:
            ax1.bar(list(bars), list(bars.values()))
            ax1.axhline(1.0, color="grey", linestyle=":")
            ax1.set_ylabel("speed-up (above 1: the first variant faster)")
            ax1.set_title(f"{rate:g} Mbit/s links")
            ax1.tick_params(axis="x", labelsize=7, rotation=30)
        else:
            ax1.axis("off")
        ax2 = fig.add_subplot(1, 3, 3)
        if "planner_validation" in figures:
            v = figures["planner_validation"]
            ys = range(len(v))
            ax2.barh([y + 0.2 for y in ys], [x["error"] * 100 for x in v], height=0.4, label="wire + CPU")
            ax2.barh([y - 0.2 for y in ys], [x["wire_only_error"] * 100 for x in v], height=0.4, label="wire only")
            ax2.set_yticks(list(ys), [x["config"] for x in v])
            ax2.axvline(15, color="red", linestyle=":", label="15%")
            ax2.set_xlabel("planner error (%)")
            ax2.tick_params(axis="y", labelsize=6)
            ax2.legend(fontsize=8)
        else:
            ax2.axis("off")

    return {"figures": figures, "markdown": "\n".join(md), "plot": plot}


def _machine_load(data: dict[str, Any]) -> str:
    if "rebuilt_from" in data:
        return "of each part beside it, 1 minute, at its start and end"
    return f"{data['machine']['load_avg_1_5_15']} at the end; each part's beside it"


def _load(rec: dict[str, Any]) -> str:
    load = rec.get("load_avg")
    return f" (load average {load[0]:g} -> {load[1]:g} on 2 cores)" if load else ""


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f} MB" if n >= 2**20 else f"{n / 2**10:.0f} KB"


if __name__ == "__main__":
    sys.exit(main())
