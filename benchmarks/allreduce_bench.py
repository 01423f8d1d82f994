"""hora's allreduce against raw ``torch.distributed.all_reduce`` on the same tensors, in the same run.

For each message size (4 KB to 256 MB, powers of 4) every rank times, alternating A B C A B C:
  raw       ``dist.all_reduce(t)`` on the default group (SUM, in place)
  hora      ``hvd.allreduce_(t, op=hvd.Sum)`` (in place, unnamed: the negotiated path a script takes)
  hora_oop  ``hvd.allreduce(t, op=hvd.Sum)`` (out of place: allocates its output)
  raw_oop   ``u = t.clone(); dist.all_reduce(u)``: what a torch.distributed user writes for the same result
  raw_b     ``dist.all_reduce`` again, on a tensor of its own: an A/A control
and reports bus bandwidth (busbw = bytes / time * 2(n-1)/n), the per-pair ratio hora/raw as a median with
its spread (in place against raw in place, out of place against raw clone + all_reduce), the microseconds
hora adds per op (per-pair median of hora - raw time), the A/A ratio raw/raw_b
(how far two identical variants drift apart on this machine: a hora/raw ratio inside that band is noise,
not hora), and the latency of a 1-element op (raw, hora unnamed, hora with a reused name).
Target: >= 0.95 of raw for >= 1 MB, tiny-op latency <= 2x raw.

    python benchmarks/allreduce_bench.py            # full run, < 5 minutes on 2 cores
    python benchmarks/allreduce_bench.py --quick    # 3 sizes, few samples, ~20 s: reports in out/bench-quick/
    python benchmarks/allreduce_bench.py --launcher hora   # ranks started by hora.run instead of fork
    python benchmarks/allreduce_bench.py --sizes 1MB --repeats 61  # one size, finer: allreduce_bench_1MB.md

Writes benchmarks/results/allreduce_bench.{json,md,png} (``--out`` to change the directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    add_output_flags,
    alternate,
    difference_summary,
    fork_ranks,
    human_bytes,
    machine_info,
    markdown_table,
    output_dir,
    ratio_summary,
    summarize,
    write_results,
)

FULL_SIZES = [4 * 1024 * 4**i for i in range(9)]  # 4 KB .. 256 MB
QUICK_SIZES = [4 * 1024, 1024 * 1024, 16 * 1024 * 1024]
VARIANTS = ("raw", "hora", "hora_oop", "raw_oop", "raw_b")
TINY_VARIANTS = ("raw", "hora", "hora_named")


def _iterations(sample_call: Any, target_s: float, max_iters: int) -> int:
    """How many calls make one sample last about ``target_s``, agreed by every rank (rank 0 decides)."""
    import torch
    import torch.distributed as dist

    sample_call()
    times: list[float] = []
    for _ in range(3):  # the fastest of a few calls: one stray delay can't skew it. The same count on every
        start = time.perf_counter()  # rank: a count decided by each rank's own clock let them fall out of step
        sample_call()
        times.append(time.perf_counter() - start)
    one = max(min(times), 1e-6)
    n = torch.tensor([max(1, min(max_iters, int(target_s / one)))], dtype=torch.int64)
    dist.broadcast(n, 0)
    return int(n.item())


def _timer(call: Any, iters: int) -> Any:
    import torch.distributed as dist

    def sample() -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - start) / iters

    return sample


def _measure(nbytes: int, repeats: int, target_s: float) -> tuple[int, dict[str, list[float]]]:
    """Alternating samples of the four variants on fresh float32 tensors of ``nbytes``."""
    import torch
    import torch.distributed as dist

    import hora as hvd

    n = nbytes // 4
    raw_t, hora_t, oop_t, raw_oop_t, raw_b_t = (torch.zeros(n) for _ in VARIANTS)  # zeros: sums never overflow

    def raw_oop() -> torch.Tensor:  # what a torch.distributed user writes for a result in a new tensor
        out = raw_oop_t.clone()
        dist.all_reduce(out)
        return out

    calls = {
        "raw": lambda: dist.all_reduce(raw_t),
        "hora": lambda: hvd.allreduce_(hora_t, op=hvd.Sum),
        "hora_oop": lambda: hvd.allreduce(oop_t, op=hvd.Sum),
        "raw_oop": raw_oop,
        "raw_b": lambda: dist.all_reduce(raw_b_t),
    }
    iters = _iterations(calls["raw"], target_s, 2000)
    return iters, alternate({k: _timer(c, iters) for k, c in calls.items()}, repeats)


def _worker(sizes: list[int], repeats: int, target_s: float) -> dict[str, Any] | None:
    """One rank's whole measurement; rank 0 returns the samples."""
    import torch
    import torch.distributed as dist

    import hora as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {"sizes": {}, "iters": {}}
    for nbytes in sizes:
        out["iters"][nbytes], out["sizes"][nbytes] = _measure(nbytes, repeats, target_s)
    one = [torch.zeros(1) for _ in range(3)]
    tiny = {
        "raw": lambda: dist.all_reduce(one[0]),
        "hora": lambda: hvd.allreduce_(one[1], op=hvd.Sum),
        "hora_named": lambda: hvd.allreduce_(one[2], op=hvd.Sum, name="bench.tiny"),
    }
    iters = _iterations(tiny["raw"], target_s, 5000)
    out["tiny_iters"] = iters
    out["tiny"] = alternate({k: _timer(c, iters) for k, c in tiny.items()}, repeats)
    hvd.shutdown()
    return out if rank == 0 else None


def _forked_worker(rank: int, size: int, sizes: list[int], repeats: int, target_s: float) -> dict[str, Any] | None:
    return _worker(sizes, repeats, target_s)


def busbw(nbytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: bytes / time * 2(n-1)/n (what each link carries in a ring allreduce)."""
    return nbytes / seconds * 2 * (nranks - 1) / nranks / 1e9


def analyse(raw: dict[str, Any], nranks: int) -> dict[str, Any]:
    """Medians, bandwidths and per-pair ratios from rank 0's samples."""
    rows = []
    for nbytes, samples in raw["sizes"].items():
        s = {k: summarize(v) for k, v in samples.items()}
        rows.append({
            "bytes": nbytes,
            "iters": raw["iters"][nbytes],
            **{f"{k}_s": s[k]["median"] for k in VARIANTS},
            **{f"{k}_busbw": busbw(nbytes, s[k]["median"], nranks) for k in VARIANTS},
            "ratio": ratio_summary(samples["raw"], samples["hora"]),  # busbw hora / busbw raw
            "ratio_oop": ratio_summary(samples["raw_oop"], samples["hora_oop"]),  # vs clone + all_reduce
            "added_us": difference_summary(samples["hora"], samples["raw"]),  # µs per op
            "ratio_aa": ratio_summary(samples["raw"], samples["raw_b"]),  # A/A: what noise alone gives
        })
    tiny = {k: summarize(v) for k, v in raw["tiny"].items()}
    return {
        "rows": rows,
        "tiny": {
            **{f"{k}_us": tiny[k]["median"] * 1e6 for k in TINY_VARIANTS},
            "latency_ratio": ratio_summary(raw["tiny"]["hora"], raw["tiny"]["raw"]),  # hora / raw time
            "latency_ratio_named": ratio_summary(raw["tiny"]["hora_named"], raw["tiny"]["raw"]),
        },
    }


def _pct(r: dict[str, float]) -> str:
    return f"{r['median']:.2f} (±{r['spread'] / 2 * 100:.0f}%)"


def to_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    rows = [[human_bytes(r["bytes"]), f"{r['raw_busbw']:.3f}", f"{r['hora_busbw']:.3f}", _pct(r["ratio"]),
             _goal(r["ratio"]["median"] >= 0.95) if r["bytes"] >= 2**20 else "",
             f"{r['added_us']['median']:+.0f}", _pct(r["ratio_aa"]),
             f"{r['raw_oop_busbw']:.3f}", f"{r['hora_oop_busbw']:.3f}", _pct(r["ratio_oop"]), r["iters"]]
            for r in result["rows"]]
    table = markdown_table(["size", "raw busbw GB/s", "hora busbw GB/s", "hora/raw", ">= 0.95?", "hora adds µs/op",
                            "A/A raw/raw", "raw clone+all_reduce GB/s", "hora allreduce GB/s",
                            "hora allreduce / raw clone+all_reduce", "iters/sample"], rows)
    t = result["tiny"]
    tiny = markdown_table(["1-element allreduce", "raw µs", "hora µs", "hora/raw time", "hora named µs",
                           "named/raw time"],
                          [["latency", f"{t['raw_us']:.0f}", f"{t['hora_us']:.0f}",
                            _pct(t["latency_ratio"]) + " " + _goal(t["latency_ratio"]["median"] <= 2.0),
                            f"{t['hora_named_us']:.0f}", _pct(t["latency_ratio_named"])]])
    m = meta["machine"]
    load = f"load average {meta['load_start'][0]} at start, {m['load_avg_1_5_15'][0]} at end (2 cores)"
    return (f"# hora allreduce vs torch.distributed.all_reduce ({meta['nranks']} ranks, Gloo, CPU)\n\n"
            f"{m['utc']}, {m['cpu']} x{m['cpus']}, torch {m['torch']}, hora {m['hora']} ({m['git_commit']}); "
            f"median of {meta['repeats']} alternating samples (order rotated each cycle); ratio = per-pair raw "
            f"time / hora time (= busbw ratio), ± half the min-max spread; A/A = the same ratio between two "
            f"identical raw variants (the noise band of this machine). In place: hora `allreduce_(t)` against "
            f"raw `all_reduce(t)`; out of place (a new result tensor): hora `allreduce(t)` against raw "
            f"`u = t.clone(); all_reduce(u)`; {load}. "
            f"Target: >= 0.95 for >= 1 MB; tiny latency <= 2x.\n\n"
            f"{table}\n{tiny}")


def _goal(met: bool) -> str:
    return "yes" if met else "**no**"


def plot(result: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        sizes = [r["bytes"] for r in result["rows"]]
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        for key, label in (("raw", "all_reduce(t)"), ("hora", "hora allreduce_(t)"),
                           ("raw_oop", "clone + all_reduce"), ("hora_oop", "hora allreduce(t)")):
            ax1.plot(sizes, [r[f"{key}_busbw"] for r in result["rows"]], marker="o", label=label)
        ax1.set_ylabel("bus bandwidth (GB/s)")
        ax1.set_yscale("log")
        ax1.legend()
        ax1.grid(True, alpha=0.3)
        med = [r["ratio"]["median"] for r in result["rows"]]
        lo = [r["ratio"]["median"] - r["ratio"]["min"] for r in result["rows"]]
        hi = [r["ratio"]["max"] - r["ratio"]["median"] for r in result["rows"]]
        ax2.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label="hora / raw (min-max)")
        ax2.fill_between(sizes, [r["ratio_aa"]["min"] for r in result["rows"]],
                         [r["ratio_aa"]["max"] for r in result["rows"]], color="grey", alpha=0.25,
                         label="raw / raw A/A (noise band)")
        ax2.axhline(0.95, color="red", linestyle="--", label="target 0.95")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("message size (bytes)")
        ax2.set_ylabel("busbw ratio")
        ax2.legend()
        ax2.grid(True, alpha=0.3)

    return draw


def _sizes(text: str) -> list[int]:
    """``"4KB,1MB"`` -> ``[4096, 1048576]`` (B, KB, MB, GB; powers of 1024; a multiple of 4 bytes)."""
    units = {"GB": 1 << 30, "MB": 1 << 20, "KB": 1 << 10, "B": 1}
    sizes = []
    for part in text.replace(" ", "").upper().split(","):
        unit = next((u for u in units if part.endswith(u)), "B")
        try:
            n = int(float(part.removesuffix(unit) or "x") * units[unit])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a size like 4KB or 1MB") from None
        if n < 4 or n % 4:
            raise argparse.ArgumentTypeError(f"{part!r}: sizes are whole float32 tensors (>= 4 bytes, a multiple of 4)")
        sizes.append(n)
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(p, "3 sizes, 3 samples, short samples (~20 s)")
    p.add_argument("-np", "--nranks", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="alternating samples per variant (default 11)")
    p.add_argument("--sizes", type=_sizes, default=None, metavar="LIST",
                   help="message sizes to measure, e.g. 1MB,4MB (default 4 KB to 256 MB in powers of 4)")
    p.add_argument("--launcher", choices=["fork", "hora"], default="fork",
                   help="start ranks by fork (default) or with hora.run (hora's own launcher)")
    args = p.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (3 if args.quick else 11)
    target_s = 0.02 if args.quick else 0.1
    start = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    if args.launcher == "hora":
        import hora

        here = str(Path(__file__).resolve().parent)  # workers unpickle references to common.py
        raw = hora.run(_worker, args=(sizes, repeats, target_s), num_proc=args.nranks, env={"PYTHONPATH": here})[0]
    else:
        raw = fork_ranks(_forked_worker, args.nranks, sizes, repeats, target_s)[0]
    result = analyse(raw, args.nranks)
    meta = {"nranks": args.nranks, "launcher": args.launcher, "repeats": repeats, "quick": args.quick,
            "load_start": load_start,
            "target_sample_s": target_s, "machine": machine_info(), "wall_s": round(time.monotonic() - start, 1)}
    name = "allreduce_bench"
    if args.sizes:  # a focused run is reported beside the full one, not over it
        name += "_" + "_".join(human_bytes(n).replace(" ", "") for n in sizes)
    md = to_markdown(result, meta)
    paths = write_results(name, {"meta": meta, "samples": raw, "result": result}, md, plot(result), output_dir(args))
    print(md)
    print("wrote " + ", ".join(str(p) for p in paths) + f" in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
