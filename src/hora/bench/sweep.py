"""``hora bench allreduce``: for each message size, hora's allreduce against raw ``torch.distributed`` in
the same run, alternated with a rotating order, with algbw and busbw as nccl-tests define them:

* algbw = S / t, for S the bytes of the tensor a rank passes in and t the time of one allreduce;
* busbw = algbw * 2(n-1)/n, the bytes each rank's link carries per second in a ring allreduce of n ranks,
  comparable to a link's line rate whatever n is.

With ``--compression fp16|bf16`` hora sends half the bytes; S stays the uncompressed size (what the user
reduces), so the busbw then says how fast gradients are synchronised, not what the wire carried. With
several hosts the sweep also times raw allreduce inside each host (*intra*) and among one rank per host
(*inter*): the per-link-type figures ``hora bench plan`` fits its model to.

Example:
    hora run -np 4 -H a:2,b:2 hora bench allreduce --sizes 1KB..256MB --json sweep.json --plot sweep.png
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import hora as hvd
from hora.bench import cpu
from hora.bench.report import Progress, human_bytes, markdown_table, noise_warning, noisy_mark
from hora.bench.timing import alternate, ratio_summary, summarize
from hora.datapath.wire import Compression, Compressor
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int32": torch.int32, "int64": torch.int64}
COMPRESSIONS: dict[str, Compressor] = {"none": Compression.none, "fp16": Compression.fp16,
                                       "bf16": Compression.bf16}


@dataclass(frozen=True)
class SweepConfig:
    sizes: Sequence[int]
    dtype: str = "float32"
    compression: str = "none"
    repeats: int = 5  # alternation cycles per size
    sample_s: float = 0.2  # one sample lasts about this long
    max_iters: int = 200
    links: bool = True  # also time the intra-host and inter-host groups when there are several hosts


def bus_factor(n: int) -> float:
    """nccl-tests' allreduce bus bandwidth factor 2(n-1)/n (0 for one rank: nothing crosses a link)."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def _iterations(call: Callable[[], Any], cfg: SweepConfig, group: Any = None) -> int:
    """How many calls make one sample last about ``sample_s``; rank 0 of the group decides for all."""
    call()
    times: list[float] = []
    for _ in range(3):  # a fixed count: every member must issue the same collectives, whatever its clock says
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    one = max(min(times), 1e-6)
    n = torch.tensor([max(1, min(cfg.max_iters, int(cfg.sample_s / one)))], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)  # every member agrees (MAX: no root to name)
    return int(n.item())


def _timer(call: Callable[[], Any], iters: int, group: Any = None) -> Callable[[], float]:
    def sample() -> float:
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - start) / iters

    return sample


def _bandwidth(size: int, seconds: float, n: int) -> dict[str, float]:
    algbw = size / seconds / 1e9
    return {"time_s": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(n)}


def sweep_world(cfg: SweepConfig, progress: Progress) -> list[dict[str, Any]]:
    """hora against raw on every rank, one row per size."""
    dtype = DTYPES[cfg.dtype]
    compression = COMPRESSIONS[cfg.compression]
    n = hvd.size()
    rows = []
    for size in cfg.sizes:
        numel = max(1, size // torch.empty(0, dtype=dtype).element_size())
        raw_t = torch.zeros(numel, dtype=dtype)
        hora_t = torch.zeros(numel, dtype=dtype)

        def raw(raw_t: torch.Tensor = raw_t) -> None:
            dist.all_reduce(raw_t)

        def hora_call(hora_t: torch.Tensor = hora_t) -> None:
            if compression is Compression.none:
                hvd.allreduce_(hora_t, op=hvd.Sum)
            else:
                hvd.allreduce(hora_t, op=hvd.Sum, compression=compression)

        def tick(size: int = size) -> None:
            progress.step(human_bytes(size))

        iters = _iterations(raw, cfg)
        samples = alternate({"raw": _timer(raw, iters), "hora": _timer(hora_call, iters)}, cfg.repeats,
                            after_each=tick)
        nbytes = numel * raw_t.element_size()
        raw_s, hora_s = summarize(samples["raw"])["median"], summarize(samples["hora"])["median"]
        ratio = ratio_summary(samples["raw"], samples["hora"])  # per cycle; > 1: hora faster
        rows.append({"size": nbytes, "iters": iters, "ranks": n,
                     "raw": _bandwidth(nbytes, raw_s, n) | {"spread": summarize(samples["raw"])["spread"]},
                     "hora": _bandwidth(nbytes, hora_s, n) | {"spread": summarize(samples["hora"])["spread"]},
                     "speed_vs_raw": ratio,  # the summary of the per-cycle ratios raw / hora
                     "speed_vs_raw_of_medians": raw_s / hora_s,  # the table's figure: the medians beside it
                     "samples": samples})
    return rows


def _link_groups() -> dict[str, tuple[Any, int, bool]]:
    """Groups to time per link type: name -> (group, members, this rank takes part). Every rank creates
    every group in the same order (``new_group`` is collective)."""
    topo = runtime.state("hora bench allreduce").topo
    hosts = topo.hosts or (tuple(range(topo.size)),)
    out: dict[str, tuple[Any, int, bool]] = {}
    if len(hosts) < 2:
        return out
    widest = max(hosts, key=len)
    if len(widest) > 1:
        intra = dist.new_group(ranks=list(widest))  # one host's ranks: the intra-host link
        out["intra"] = (intra, len(widest), topo.rank in widest)
    leaders = [h[0] for h in hosts]
    cross = dist.new_group(ranks=leaders)
    out["inter"] = (cross, len(leaders), topo.rank in leaders)
    return out


def sweep_links(cfg: SweepConfig, progress: Progress) -> dict[str, list[dict[str, Any]]]:
    """Raw allreduce per link type (see the module doc); ranks outside a group wait at a barrier."""
    dtype = DTYPES[cfg.dtype]
    result: dict[str, list[dict[str, Any]]] = {}
    for name, (group, members, mine) in _link_groups().items():
        rows = []
        for size in cfg.sizes:
            numel = max(1, size // torch.empty(0, dtype=dtype).element_size())
            t = torch.zeros(numel, dtype=dtype)
            row: dict[str, Any] = {"size": numel * t.element_size(), "ranks": members}
            if mine:
                def call(t: torch.Tensor = t, group: Any = group) -> None:
                    dist.all_reduce(t, group=group)

                iters = _iterations(call, cfg, group)
                samples = alternate({"raw": _timer(call, iters, group)}, cfg.repeats)["raw"]
                row.update(_bandwidth(row["size"], summarize(samples)["median"], members), samples=samples)
            gathered: list[Any] = [None] * hvd.size()
            dist.all_gather_object(gathered, row if mine else None)  # rank 0 reports a member's figures
            rows.append(next(r for r in gathered if r is not None))
            progress.step(f"{name} {human_bytes(size)}")
        result[name] = rows
    return result


def run(cfg: SweepConfig) -> dict[str, Any]:
    """The whole sweep on this rank; every rank returns the same record."""
    n_links = 0
    if cfg.links:
        topo = runtime.state("hora bench allreduce").topo
        hosts = topo.hosts or ((0,),)
        n_links = (2 if len(hosts) > 1 and max(len(h) for h in hosts) > 1 else 1) if len(hosts) > 1 else 0
    progress = Progress(len(cfg.sizes) * (cfg.repeats + n_links), "allreduce", enabled=hvd.rank() == 0)
    # hora's local passes (copy, casts, scaling) for the planner, at the sweep's largest size (1-64 MB)
    rates = cpu.measure(min(64 * 2**20, max(2**20, *cfg.sizes)))
    every: list[Any] = [None] * hvd.size()
    dist.all_gather_object(every, rates.as_dict())
    slowest = cpu.CpuRates.from_dict(every[0])
    for other in every[1:]:
        slowest = slowest.slowest(cpu.CpuRates.from_dict(other))
    rows = sweep_world(cfg, progress)
    links = sweep_links(cfg, progress) if cfg.links else {}
    progress.close()
    topo = runtime.state().topo
    return {"kind": "allreduce", "ranks": hvd.size(), "hosts": len(topo.hosts) or 1,
            "ranks_per_host": [len(h) for h in topo.hosts], "dtype": cfg.dtype, "compression": cfg.compression,
            "hierarchical": runtime.hierarchy() is not None, "repeats": cfg.repeats, "rows": rows,
            "links": links, "cpu": slowest.as_dict()}


def markdown(result: dict[str, Any]) -> str:
    """The sweep as a Markdown table: one row per size."""
    headers = ["size", "raw time", "raw algbw GB/s", "raw busbw GB/s", "hora time", "hora algbw GB/s",
               "hora busbw GB/s", "hora speed vs raw (raw time / hora time)", "spread (per cycle)"]
    rows = []
    marked = 0
    for r in result["rows"]:
        per_cycle = r["speed_vs_raw"]["spread"]
        mark = noisy_mark(per_cycle, r["raw"]["spread"], r["hora"]["spread"])
        marked += bool(mark)
        rows.append([human_bytes(r["size"]) + mark, _t(r["raw"]["time_s"]), f"{r['raw']['algbw_GBps']:.3f}",
                     f"{r['raw']['busbw_GBps']:.3f}", _t(r["hora"]["time_s"]), f"{r['hora']['algbw_GBps']:.3f}",
                     f"{r['hora']['busbw_GBps']:.3f}", f"{r['speed_vs_raw_of_medians']:.2f}x", f"{per_cycle:.0%}"])
    title = (f"allreduce, {result['ranks']} ranks on {result['hosts']} host(s), {result['dtype']}, compression "
             f"{result['compression']}{', hierarchical' if result['hierarchical'] else ''}; "
             f"median of {result['repeats']} alternated samples\n\n")
    text = title + markdown_table(headers, rows) + noise_warning(marked, len(rows))
    for name, link_rows in result["links"].items():
        text += f"\nraw allreduce on the {name}-host link ({link_rows[0]['ranks']} ranks)\n\n"
        text += markdown_table(["size", "time", "algbw GB/s", "busbw GB/s"],
                               [[human_bytes(r["size"]), _t(r["time_s"]), f"{r['algbw_GBps']:.3f}",
                                 f"{r['busbw_GBps']:.3f}"] for r in link_rows])
    return text


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def plot(result: dict[str, Any]) -> Callable[[Any], None]:
    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        sizes = [r["size"] for r in result["rows"]]
        ax.plot(sizes, [r["raw"]["busbw_GBps"] for r in result["rows"]], "o-", label="raw torch.distributed")
        ax.plot(sizes, [r["hora"]["busbw_GBps"] for r in result["rows"]], "s-",
                label=f"hora (compression {result['compression']})")
        for name, rows in result["links"].items():
            ax.plot([r["size"] for r in rows], [r["busbw_GBps"] for r in rows], "--", label=f"raw, {name}-host")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"allreduce busbw, {result['ranks']} ranks on {result['hosts']} host(s)")
        ax.legend()
        ax.grid(True, alpha=0.3)

    return draw
