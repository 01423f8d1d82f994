"""``hora bench plan``: an alpha-beta model per link type, fitted to an allreduce sweep, that predicts
allreduce time, step time and scaling efficiency for other sizes, host counts and layouts.

The model (Hockney's): sending m bytes over a link costs ``alpha + m * beta``. A ring allreduce of S bytes
on n ranks takes 2(n-1) steps of S/n bytes each, so ``T = 2(n-1) * alpha + 2(n-1)/n * S * beta``, and the
slowest link on the ring sets alpha and beta. Per link type:

* ``intra``: between ranks on one host (loopback, shared memory);
* ``inter``: between hosts (the network).

Predictions:

* flat ring on h hosts x p ranks: every step crosses the network when h > 1 (inter), else intra;
* hierarchical: an intra allreduce of S on p ranks (reduce + broadcast) plus an inter allreduce on h;
* parameter server with N workers, the server one of them: the server's link carries (N-1) S in and out;
  with the data sent in K chunks, receiving and sending overlap except for one chunk:
  ``T = (N-1) * S * beta * (1 + 1/K) + 2 * alpha * K``;
* a training step: compute (measured on one rank) plus gradient sync of the model's bytes in buckets, with
  ``overlap`` the fraction of the sync hidden behind backward (0 = none, the conservative default).

Scaling efficiency = compute / step time.

Example:
    >>> fit = LinkFit.fit([(1e6, 2, 0.0105), (4e6, 2, 0.0405), (16e6, 2, 0.1605)])
    >>> round(fit.beta * 1e9, 2), round(fit.alpha * 1e6)
    (10.0, 250)
    >>> round(fit.ring(8e6, 4) * 1e3, 1)
    121.5
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hora.bench.cpu import CpuRates, extra_seconds, pieces, with_wire
from hora.bench.report import human_bytes, markdown_table
from hora.datapath.wire import POOL_MIN_BYTES
from hora.errors import ConfigError

__all__ = ["LinkFit", "Plan", "fit_sweep", "markdown"]


@dataclass(frozen=True)
class LinkFit:
    """alpha (s per message) and beta (s per byte) of one link type, with the fit's relative error."""

    alpha: float
    beta: float
    points: int = 0
    max_rel_err: float = 0.0
    note: str = ""  # why the fit is not to be trusted, when it is not

    @classmethod
    def fit(cls, rows: Sequence[tuple[float, int, float]]) -> LinkFit:
        """Least squares of relative error over (bytes S, ranks n, seconds T) of ring allreduces."""
        xs = [(2 * (n - 1) / n * s, 2 * (n - 1), t) for s, n, t in rows if n > 1 and t > 0]
        if len(xs) < 2:
            raise ConfigError("the planner needs a sweep with at least two sizes on two or more ranks "
                              "(hora run -np 2 ... hora bench allreduce --json sweep.json)")
        # minimise sum(((a*k + b*x) - t) / t)^2 over a (alpha) and b (beta): 2x2 normal equations
        saa = sum((k / t) ** 2 for x, k, t in xs)
        sbb = sum((x / t) ** 2 for x, k, t in xs)
        sab = sum(k * x / t**2 for x, k, t in xs)
        sa = sum(k / t for x, k, t in xs)
        sb = sum(x / t for x, k, t in xs)
        det = saa * sbb - sab * sab
        if abs(det) < 1e-300:
            raise ConfigError("the sweep's sizes are too alike to fit a latency and a bandwidth: sweep a range")
        alpha = (sa * sbb - sb * sab) / det
        beta = (sb * saa - sa * sab) / det
        note = ""
        if beta <= 0:
            note = "times did not grow with size: the sweep saw no bandwidth limit; sweep larger sizes (up to 256MB)"
        alpha, beta = max(alpha, 0.0), max(beta, 1e-15)
        errs = [abs((alpha * k + beta * x) - t) / t for x, k, t in xs]
        return cls(alpha=alpha, beta=beta, points=len(xs), max_rel_err=max(errs), note=note)

    def ring(self, nbytes: float, n: int) -> float:
        """Seconds for a ring allreduce of ``nbytes`` on ``n`` ranks over this link."""
        if n < 2:
            return 0.0
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes * self.beta

    @property
    def gbps(self) -> float:
        """The fitted bandwidth in Gbit/s."""
        return 8 / self.beta / 1e9


@dataclass(frozen=True)
class Plan:
    """Fitted links; predictions for any layout."""

    inter: LinkFit | None
    intra: LinkFit | None
    cpu: CpuRates | None = None  # the sweep's timing of hora's local passes (copies, casts, scaling)
    wire16: LinkFit | None = None  # the network carrying 16-bit data (Gloo sums it more slowly than float32)

    def _link(self, kind: str) -> LinkFit:
        link = self.inter if kind == "inter" else self.intra
        if link is None:
            other = self.intra if kind == "inter" else self.inter
            if other is None:
                raise ConfigError("no link was fitted: build the plan with fit_sweep() from a sweep record")
            return other  # the best estimate we have (a one-host sweep has no inter link)
        return link

    def allreduce(self, nbytes: float, hosts: int, per_host: int = 1, hierarchical: bool = False) -> float:
        """Seconds for one allreduce of ``nbytes`` on ``hosts`` x ``per_host`` ranks."""
        if hosts == 1:
            return self._link("intra").ring(nbytes, per_host)
        if hierarchical and per_host > 1:
            return self._link("intra").ring(nbytes, per_host) + self._link("inter").ring(nbytes, hosts)
        return self._link("inter").ring(nbytes, hosts * per_host)

    def hora_allreduce(self, nbytes: float, hosts: int, per_host: int = 1, compression: str = "none",
                       call: str = "inplace", average: bool = False, hierarchical: bool = False) -> float:
        """Seconds for hora's allreduce of ``nbytes`` of float32: the wire (half the bytes when compressed)
        plus the CPU passes hora adds (:mod:`hora.bench.cpu`), when the sweep timed them."""
        compressed = compression != "none"
        wire = nbytes / 2 if compressed else nbytes
        if compressed and self.wire16 is not None and hosts > 1 and not hierarchical:
            seconds = self.wire16.ring(wire, hosts * per_host)
        else:
            seconds = self.allreduce(wire, hosts, per_host, hierarchical)
        if self.cpu is not None:
            extra = extra_seconds(self.cpu, nbytes, hosts * per_host, compression, call, average)
            seconds = with_wire(seconds, extra, pieces(nbytes, compression, call))
        return seconds

    def parameter_server(self, nbytes: float, workers: int, chunks: int = 1) -> float:
        """Seconds for one gradient exchange through a server that is one of ``workers`` single-rank hosts."""
        link = self._link("inter")
        if workers < 2:
            return 0.0
        return (workers - 1) * nbytes * link.beta * (1 + 1 / chunks) + 2 * link.alpha * chunks

    def step(self, compute_s: float, grad_bytes: float, hosts: int, per_host: int = 1, bucket_bytes: float = 25e6,
             overlap: float = 0.0, hierarchical: bool = False, compression: str = "none") -> dict[str, float]:
        """Predicted step time and scaling efficiency of data-parallel training (the DistributedOptimizer's
        buckets are reused: no copy beyond the casts of a compressed wire)."""
        if hosts * per_host < 2:
            return {"step_s": compute_s, "sync_s": 0.0, "efficiency": 1.0}
        buckets = max(1, math.ceil(grad_bytes / bucket_bytes))
        sync = sum(self.hora_allreduce(grad_bytes / buckets, hosts, per_host, compression, call="bucket",
                                       hierarchical=hierarchical) for _ in range(buckets))
        step = compute_s + max(0.0, sync - overlap * compute_s) if overlap else compute_s + sync
        return {"step_s": step, "sync_s": sync, "efficiency": compute_s / step if step else 1.0}


def _rows(records: Sequence[dict[str, Any]]) -> list[tuple[float, int, float]]:
    return [(r["size"], r["ranks"], r["time_s"]) for r in records if "time_s" in r]


def fit_sweep(sweep: dict[str, Any], min_bytes: int = 0) -> Plan:
    """Fit the links of a ``hora bench allreduce --json`` record (sizes below ``min_bytes`` left out)."""
    if sweep.get("kind") != "allreduce":
        raise ConfigError("hora bench plan needs the JSON of `hora bench allreduce --json PATH`")
    world = [{"size": r["size"], "ranks": r["ranks"], "time_s": r["raw"]["time_s"]} for r in sweep["rows"]]
    links = sweep.get("links", {})

    def keep(rows: list[tuple[float, int, float]]) -> list[tuple[float, int, float]]:
        return [r for r in rows if r[0] >= min_bytes]

    per_host = sweep.get("ranks_per_host") or [sweep["ranks"]]
    inter = intra = None
    if "inter" in links:
        inter = LinkFit.fit(keep(_rows(links["inter"])))
    elif sweep.get("hosts", 1) > 1 and max(per_host) == 1:
        inter = LinkFit.fit(keep(_rows(world)))  # one rank per host: the world ring is the network
    if "intra" in links:
        intra = LinkFit.fit(keep(_rows(links["intra"])))
    elif sweep.get("hosts", 1) == 1:
        intra = LinkFit.fit(keep(_rows(world)))
    if inter is None and intra is None:
        raise ConfigError("the sweep ran on several hosts with several ranks per host but has no per-link timings "
                          "(it was run with --no-links), so neither link can be fitted; run `hora bench allreduce "
                          "--json PATH` again without --no-links")
    cpu = CpuRates.from_dict(sweep["cpu"]) if sweep.get("cpu") else None
    return Plan(inter=inter, intra=intra, cpu=cpu, wire16=_fit_wire16(sweep, cpu, min_bytes))


def _fit_wire16(sweep: dict[str, Any], cpu: CpuRates | None, min_bytes: int) -> LinkFit | None:
    """From a sweep run with ``--compression fp16|bf16`` on one rank per host: the 16-bit wire, fitted to hora's
    compressed allreduces (their 16-bit bytes) less the CPU passes timed beside them; on the sizes whose 16-bit
    wire comes from a reused buffer (>= 2 x POOL_MIN_BYTES of float32) when the sweep has two or more."""
    per_host = sweep.get("ranks_per_host") or [sweep["ranks"]]
    if sweep.get("compression", "none") == "none" or cpu is None or sweep.get("hosts", 1) < 2 or max(per_host) > 1:
        return None
    rows = []
    # the sizes hora sends from reused buffers in pieces, as the predictions assume; all when fewer than two
    reused = [r for r in sweep["rows"] if r["size"] >= max(min_bytes, 2 * POOL_MIN_BYTES)]
    for r in reused if len(reused) >= 2 else sweep["rows"]:
        if r["size"] < min_bytes:
            continue
        local = extra_seconds(cpu, r["size"], r["ranks"], sweep["compression"], "out_of_place")
        # the inverse of with_wire where the wire is the longer: the casts of one piece are not overlapped
        local /= pieces(r["size"], sweep["compression"], "out_of_place")
        if r["hora"]["time_s"] > local:
            rows.append((r["size"] / 2, r["ranks"], r["hora"]["time_s"] - local))
    try:
        return LinkFit.fit(rows)
    except ConfigError:
        return None


def predictions(plan: Plan, grad_bytes: float, hosts: Sequence[int], per_host: int, compute_s: float | None,
                overlap: float, compression: str = "none") -> list[dict[str, Any]]:
    out = []
    for h in hosts:
        row: dict[str, Any] = {"hosts": h, "ranks_per_host": per_host, "compression": compression,
                               "allreduce_s": plan.allreduce(grad_bytes, h, per_host),
                               "hora_allreduce_s": plan.hora_allreduce(grad_bytes, h, per_host, compression,
                                                                       call="out_of_place", average=True),
                               "ps_s": plan.parameter_server(grad_bytes, h, chunks=8) if per_host == 1 else None}
        if per_host > 1 and h > 1:
            row["hierarchical_s"] = plan.allreduce(grad_bytes, h, per_host, hierarchical=True)
        if compute_s is not None:
            row.update(plan.step(compute_s, grad_bytes, h, per_host, overlap=overlap, compression=compression))
        out.append(row)
    return out


def markdown(plan: Plan, rows: Sequence[dict[str, Any]], grad_bytes: float) -> str:
    text = "fitted links (alpha-beta, relative least squares)\n\n"
    fits = [[name, f"{fit.alpha * 1e6:.1f} µs", "-" if fit.note else f"{fit.gbps:.3f} Gbit/s", fit.points,
             f"{fit.max_rel_err:.0%}", fit.note or "-"]
            for name, fit in (("inter-host", plan.inter), ("intra-host", plan.intra),
                              ("inter-host, 16-bit data", plan.wire16)) if fit is not None]
    text += markdown_table(["link", "alpha", "bandwidth (1/beta)", "points", "worst fit error", "note"], fits)
    if plan.cpu is not None:
        per = 100 * 2**20
        text += ("\nCPU passes hora adds, timed by the sweep (per 100 MB): copy "
                 f"{plan.cpu.copy * per * 1e3:.0f} ms, cast to 16-bit {plan.cpu.cast_down * per * 1e3:.0f} ms, "
                 f"cast back {plan.cpu.cast_up * per * 1e3:.0f} ms, scale {plan.cpu.scale * per * 1e3:.0f} ms\n")
    text += f"\npredictions for {human_bytes(grad_bytes)} of gradients\n\n"
    compression = rows[0].get("compression", "none") if rows else "none"
    headers = ["hosts", "ranks/host", "ring allreduce", f"hvd.allreduce (Average, {compression}, + CPU)",
               "hierarchical", "parameter server (8 chunks)", "step time", "scaling efficiency"]
    table = []
    for r in rows:
        table.append([r["hosts"], r["ranks_per_host"], f"{r['allreduce_s'] * 1e3:.1f} ms",
                      f"{r['hora_allreduce_s'] * 1e3:.1f} ms",
                      f"{r['hierarchical_s'] * 1e3:.1f} ms" if r.get("hierarchical_s") is not None else "-",
                      f"{r['ps_s'] * 1e3:.1f} ms" if r.get("ps_s") is not None else "-",
                      f"{r['step_s'] * 1e3:.1f} ms" if "step_s" in r else "-",
                      f"{r['efficiency']:.2f}" if "efficiency" in r else "-"])
    return text + markdown_table(headers, table)


def as_dict(plan: Plan) -> dict[str, Any]:
    return {"inter": asdict(plan.inter) if plan.inter else None, "intra": asdict(plan.intra) if plan.intra else None,
            "cpu": plan.cpu.as_dict() if plan.cpu else None, "wire16": asdict(plan.wire16) if plan.wire16 else None}
