"""``hora bench control``'s projection: models fitted to the counts of :mod:`hora.bench.control` (8 to 128 ranks
on one machine) and to a link's alpha-beta fit (:mod:`hora.bench.planner`), evaluated at 1,024 and 4,096 ranks,
with the rank count at which each limit is crossed.

**Counts.** Each count c(n) is fitted with the polynomial in n of the lowest degree, 0, 1 or 2, that is within
10% of every measured point (least squares of the relative error; a quadratic whose growth slows down is not
taken); CPU times with degree 1 at most. Counts of
the current design are exact polynomials (a mesh round is 2(n-1) messages per rank), so their fits are exact
where the data is.

**Times** (a model of a cluster where every rank has its own core; the one machine's times are contention):

* a negotiation round = the link's latency steps + the larger of a rank's CPU per round (fitted to what each
  rank used here, CPU time, not wall) and the bytes its host sends (``ranks_per_host`` ranks' frames) at the
  link's bandwidth. Latency steps: 1 on the TCP mesh (every frame travels at once), n-1 on the Gloo plane
  (Gloo's ring allgather passes the slots along the ring);
* an init = the larger of what the single store server must serve (every rank's operations, each costing the
  server what ``control`` timed for its kind) and what one rank waits for in series (its operations, one round
  trip each, plus its CPU for init);
* an elastic reset = the shutdown round + the driver's tick and its pass over the ready keys + a new init. The
  workers wait for the next world and for each other in the store (a wait the server answers when the key
  appears, no polling); what polls is the driver, reading every worker's ready key (a check and a get) each
  tick: the load that puts on the store server (at a load of 1 it does nothing else).

Example:
    >>> fit = Fit.fit([8, 16, 32], [14, 30, 62])
    >>> fit.degree, round(fit(1024))
    (1, 2046)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hora.bench.control_report import at
from hora.bench.planner import LinkFit, Plan
from hora.bench.report import markdown_table
from hora.engine.transport.plane import AUTO_PLANE

__all__ = ["Fit", "markdown", "project"]

DEFAULT_FD_LIMIT = 1024  # the soft RLIMIT_NOFILE most Linux distributions give a process; hora does not raise it
START_TIMEOUT_S = 60.0  # HORA_START_TIMEOUT's default: an init that takes longer fails


@dataclass(frozen=True)
class Fit:
    """``c(n) = coefs[0] + coefs[1] n + coefs[2] n^2`` (as many terms as ``degree`` + 1), or with ``log``
    ``coefs[0] + coefs[1] log2(n)``, and the growth exponent measured between the two largest n."""

    coefs: tuple[float, ...]
    exponent: float
    log: bool = False

    @property
    def degree(self) -> int:
        return len(self.coefs) - 1

    def __call__(self, n: float) -> float:
        x = math.log2(n) if self.log else n
        return sum(c * x**k for k, c in enumerate(self.coefs))

    @classmethod
    def fit(cls, ns: Sequence[float], ys: Sequence[float], max_degree: int = 2, tolerance: float = 0.1) -> Fit:
        """The polynomial of the lowest degree (up to ``max_degree``) whose largest relative error on the
        points is within ``tolerance`` (else of ``max_degree``), least squares of the relative error."""
        points = [(n, y) for n, y in zip(ns, ys) if y is not None]
        if not points:
            return cls((0.0,), 0.0)
        exponent = 0.0
        if len(points) >= 2:
            (n1, y1), (n2, y2) = points[-2], points[-1]
            if y1 > 0 and y2 > 0 and n2 != n1:
                exponent = math.log(y2 / y1) / math.log(n2 / n1)
        def within(fit: Fit) -> bool:
            return max((abs(fit(n) - y) / abs(y) for n, y in points if y), default=0.0) <= tolerance

        best: tuple[float, ...] = (0.0,)
        for degree in range(min(max_degree, len(points) - 1) + 1):
            coefs = _least_squares(points, degree)
            if degree >= 2 and coefs[-1] < 0:  # growth that slows down: an artefact of the smallest n, not a trend
                break
            best = coefs
            if within(cls(best, 0.0)):
                break
            if degree == 0 and len(points) >= 3:  # between a constant and a line: a + b log2(n)
                logs = cls(_least_squares([(math.log2(n), y) for n, y in points], 1), exponent, log=True)
                if logs.coefs[-1] > 0 and within(logs):
                    return logs
        return cls(best, exponent)

    def formula(self) -> str:
        terms = []
        for k, c in enumerate(self.coefs):
            if abs(c) < 1e-12:
                continue
            mag = f"{c:.3g}" if abs(c) < 1e4 else f"{c:.3e}"
            var = "log2(n)" if self.log else "n"
            terms.append(mag + ("" if k == 0 else f" {var}" if k == 1 else f" {var}^{k}"))
        return " + ".join(terms).replace("+ -", "- ") or "0"


def _least_squares(points: Sequence[tuple[float, float]], degree: int) -> tuple[float, ...]:
    """Coefficients minimising the sum of ((c(n) - y) / y)^2 (plain errors where y is 0)."""
    size = degree + 1
    a = [[0.0] * size for _ in range(size)]
    b = [0.0] * size
    for n, y in points:
        w = 1.0 / (y * y) if y else 1.0
        row = [n**k for k in range(size)]
        for i in range(size):
            b[i] += w * row[i] * y
            for j in range(size):
                a[i][j] += w * row[i] * row[j]
    for col in range(size):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        if abs(a[col][col]) < 1e-300:
            return tuple([*b[:1], *([0.0] * (size - 1))]) if size == 1 else _least_squares(points, degree - 1)
        for r in range(col + 1, size):
            f = a[r][col] / a[col][col]
            b[r] -= f * b[col]
            for c in range(col, size):
                a[r][c] -= f * a[col][c]
    x = [0.0] * size
    for r in reversed(range(size)):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, size))) / a[r][r]
    return tuple(x)


# --- the fitted quantities --------------------------------------------------------------------------------
def _series(rows: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], float], max_degree: int = 2) -> Fit:
    rows = sorted(rows, key=lambda r: r["ranks"])
    return Fit.fit([r["ranks"] for r in rows], [get(r) for r in rows], max_degree)


def _server_cost(by_op: dict[str, float], costs: dict[str, Any]) -> float:
    """Mean server CPU seconds per operation of a mix of operation kinds (``control``'s timings)."""
    kinds = costs["kinds"]
    cost = {"set": kinds["set"], "get": kinds["get"], "add": kinds["add"], "check": kinds["check"],
            "wait": kinds["wait_present"], "compare_set": kinds["set"], "delete_key": kinds["set"]}
    total = sum(by_op.values())
    if not total:
        return kinds["get"]["server_cpu_per_op_s"]
    return sum(n * cost.get(op, kinds["get"])["server_cpu_per_op_s"] for op, n in by_op.items()) / total


@dataclass(frozen=True)
class _Plane:
    """The fits of one control plane's fixed jobs."""

    name: str
    msgs: dict[str, Fit]  # per rank per round, warm and cold
    bytes: dict[str, Fit]
    cpu_round: dict[str, Fit]
    rounds_per_op: Fit
    store_init: Fit  # per rank
    store_init_total: Fit
    server_cost: float  # server CPU seconds per init operation
    cpu_init: Fit
    peer_sockets: Fit
    fds: Fit
    store_sockets: Fit  # this plane's connections to the store per rank
    threads: Fit
    memory_mb: Fit

    @classmethod
    def of(cls, name: str, rows: Sequence[dict[str, Any]], costs: dict[str, Any]) -> _Plane:
        phases = ("warm", "cold")
        biggest = max(rows, key=lambda r: r["ranks"])
        return cls(
            name=name,
            msgs={p: _series(rows, at(p, "msgs_per_rank")) for p in phases},
            bytes={p: _series(rows, at(p, "bytes_per_rank")) for p in phases},
            cpu_round={p: _series(rows, at(p, "cpu_per_round_s"), max_degree=1) for p in phases},
            rounds_per_op=_series(rows, lambda r: r["warm"]["rounds"] / r["warm"]["ops"]),
            store_init=_series(rows, at("init", "store", "per_rank")),
            store_init_total=_series(rows, at("init", "store", "total")),
            server_cost=_server_cost(biggest["init"]["store"]["by_op_per_rank"], costs),
            cpu_init=_series(rows, at("init", "cpu_s"), max_degree=1),
            peer_sockets=_series(rows, at("init", "census", "peer_sockets_per_rank")),
            fds=_series(rows, at("init", "census", "fds_per_rank")),
            store_sockets=_series(rows, lambda r: r["init"]["census"]["fds_by_kind_rank0"].get("tcp-store", 0)),
            threads=_series(rows, at("init", "census", "threads_per_rank")),
            memory_mb=_series(rows, at("init", "census", "private_mb_per_rank")))

    def round_s(self, n: float, phase: str, link: LinkFit | None, per_host: int) -> float:
        cpu = max(self.cpu_round[phase](n), 0.0)
        if link is None:
            return cpu
        steps = 1 if self.name == "tcp" else n - 1
        wire = per_host * self.bytes[phase](n) / 2 * link.beta  # a host sends its ranks' half of the bytes
        return steps * link.alpha + max(cpu, wire)

    def init_s(self, n: float, link: LinkFit | None) -> tuple[float, float]:
        """(what the store server must serve, what one rank waits for in series), seconds."""
        rtt = (link.alpha if link is not None else 0.0) + self.server_cost
        return self.store_init_total(n) * self.server_cost, self.store_init(n) * rtt + max(self.cpu_init(n), 0.0)


def project(record: dict[str, Any], plan: Plan | None, targets: Sequence[int] = (1024, 4096),
            per_host: int = 8) -> dict[str, Any]:
    """The projection of a ``control`` record (see the module docstring) to ``targets`` ranks, ``per_host``
    ranks on each host; ``plan`` gives the link (its inter-host fit, else its intra-host one)."""
    rows = [r for r in record["rows"] if "error" not in r]
    costs = record["store_costs"]
    link = (plan.inter or plan.intra) if plan is not None else None
    planes = {p: _Plane.of(p, [r for r in rows if r["job"].startswith("fixed") and r["plane"] == p], costs)
              for p in sorted({r["plane"] for r in rows if r["job"].startswith("fixed")})}
    elastic = [r for r in rows if r["job"] == "elastic"]
    kinds = costs["kinds"]
    tick = record.get("tick_s", 0.05)

    def ready_load(n: float) -> float:  # server CPU seconds per second of the driver's passes over the ready keys
        return n / tick * (kinds["check"]["server_cpu_per_op_s"] + kinds["get"]["server_cpu_per_op_s"])

    def auto(n: float) -> _Plane:
        return planes.get(AUTO_PLANE) or next(iter(planes.values()))

    def target(n: int) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks": n, "auto_plane": AUTO_PLANE, "planes": {}}
        for name, pl in planes.items():
            server, serial = pl.init_s(n, link)
            out["planes"][name] = {
                "msgs_per_rank_round": {p: pl.msgs[p](n) for p in pl.msgs},
                "bytes_per_rank_round": {p: pl.bytes[p](n) for p in pl.bytes},
                "round_s": {p: pl.round_s(n, p, link, per_host) for p in pl.msgs},
                "rounds_per_op": pl.rounds_per_op(n),
                "store_ops_init_per_rank": pl.store_init(n), "store_ops_init_total": pl.store_init_total(n),
                "init_s": max(server, serial), "init_server_s": server, "init_serial_s": serial,
                "peer_sockets_per_rank": pl.peer_sockets(n), "fds_per_rank": pl.fds(n),
                "fds_per_host": per_host * pl.fds(n), "store_connections": n * pl.store_sockets(n),
                "threads_per_rank": pl.threads(n), "memory_mb_per_rank": pl.memory_mb(n)}
        pl = auto(n)
        out["elastic"] = {"ready_pass_load": ready_load(n),
                          "reset_s": (pl.round_s(n, "cold", link, per_host) + tick
                                      + 2 * n * kinds["check"]["server_cpu_per_op_s"] + max(pl.init_s(n, link)))}
        if elastic:
            out["elastic"]["store_ops_reset_per_worker"] = _series(elastic, at("reset", "store", "per_rank"))(n)
        return out

    limits = _limits(planes, link, per_host, ready_load)
    chosen = [x for x in limits if x["setup"] in ("auto", "elastic")] or limits
    first = min(chosen, key=lambda x: x["ranks"]) if chosen else None
    fits = {name: {"msgs_warm": pl.msgs["warm"], "msgs_cold": pl.msgs["cold"], "bytes_warm": pl.bytes["warm"],
                   "bytes_cold": pl.bytes["cold"], "store_init_per_rank": pl.store_init,
                   "store_init_total": pl.store_init_total, "fds_per_rank": pl.fds, "peer_sockets": pl.peer_sockets,
                   "threads": pl.threads, "cpu_round_warm": pl.cpu_round["warm"], "cpu_init": pl.cpu_init}
            for name, pl in planes.items()}
    described = None if link is None else {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "gbps": link.gbps}
    return {"per_host": per_host, "link": described,
            "server_cost_s": {name: pl.server_cost for name, pl in planes.items()},
            "fits": {name: {k: {"formula": f.formula(), "exponent": f.exponent, "coefs": f.coefs}
                            for k, f in fs.items()} for name, fs in fits.items()},
            "targets": [target(n) for n in targets], "limits": limits, "first_limit": first}


def _limits(planes: dict[str, _Plane], link: LinkFit | None, per_host: int,
            ready_load: Callable[[float], float]) -> list[dict[str, Any]]:
    """The smallest rank count at which each limit is crossed (searched up to 65,536), for each plane measured
    and, when both were, for hora's own choice (AUTO_PLANE at every size)."""
    setups: dict[str, Callable[[float], _Plane]] = {name: _always(pl) for name, pl in planes.items()}
    if "tcp" in planes and "gloo" in planes:
        setups["auto"] = _always(planes[AUTO_PLANE])
    checks: list[tuple[str, str, Callable[[float], float], float]] = []
    for name, pick in setups.items():
        checks += [(name, what, value, limit) for what, value, limit in _plane_limits(pick, link, per_host)]
    checks += [("elastic", "the driver's passes over the workers' ready keys saturate the store server", ready_load,
                1.0)]
    found = []
    for setup, what, value, limit in checks:
        n = _crossing(value, limit)
        if n is not None:
            found.append({"setup": setup, "what": what, "ranks": n, "limit": limit})
    return sorted(found, key=lambda x: x["ranks"])


def _always(plane: _Plane) -> Callable[[float], _Plane]:
    return lambda n: plane


def _plane_limits(pick: Callable[[float], _Plane], link: LinkFit | None,
                  per_host: int) -> list[tuple[str, Callable[[float], float], float]]:
    """(what, its value at n, its limit) of the limits of the plane ``pick(n)`` uses at n ranks."""
    def fds(n: float) -> float:
        return pick(n).fds(n)

    def store_connections(n: float) -> float:
        return n * pick(n).store_sockets(n)

    def init(n: float) -> float:
        return max(pick(n).init_s(n, link))

    def round_warm(n: float) -> float:
        return pick(n).round_s(n, "warm", link, per_host)

    return [(f"a rank's descriptors exceed the usual soft limit of {DEFAULT_FD_LIMIT}", fds, DEFAULT_FD_LIMIT),
            (f"the store server's connections exceed the usual soft limit of {DEFAULT_FD_LIMIT}", store_connections,
             DEFAULT_FD_LIMIT),
            (f"init takes longer than the default start timeout ({START_TIMEOUT_S:g} s)", init, START_TIMEOUT_S),
            ("a warm round takes longer than 10 ms", round_warm, 0.010)]


def _crossing(value: Callable[[float], float], limit: float, top: int = 65536) -> int | None:
    """The smallest n in 2..top with value(n) >= limit, or None."""
    return next((n for n in range(2, top + 1) if value(n) >= limit), None)


# --- the tables -------------------------------------------------------------------------------------------
def _t(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:,.1f} s"


def _c(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 10 else f"{x:.1f}"


def markdown(projection: dict[str, Any]) -> str:
    link = projection["link"]
    text = (f"Projection, {projection['per_host']} ranks per host; link: "
            + (f"alpha {link['alpha_s'] * 1e6:.0f} µs, {link['gbps']:.2f} Gbit/s" if link else "none given (--sweep): "
               "times are CPU only") + "; the store server's cost per init operation: "
            + ", ".join(f"{p} {c * 1e6:.1f} µs" for p, c in projection["server_cost_s"].items()) + "\n\n")
    headers = ["ranks", "plane", "msgs/rank/round warm (cold)", "round warm (cold)", "store ops at init, per rank "
               "(total)", "init (server-bound / per-rank)", "fds/rank", "threads/rank", "store connections"]
    table = []
    for t in projection["targets"]:
        for name, p in t["planes"].items():
            mark = " (auto)" if name == t["auto_plane"] else ""
            table.append([t["ranks"], name + mark,
                          f"{_c(p['msgs_per_rank_round']['warm'])} ({_c(p['msgs_per_rank_round']['cold'])})",
                          f"{_t(p['round_s']['warm'])} ({_t(p['round_s']['cold'])})",
                          f"{_c(p['store_ops_init_per_rank'])} ({_c(p['store_ops_init_total'])})",
                          f"{_t(p['init_s'])} ({_t(p['init_server_s'])} / {_t(p['init_serial_s'])})",
                          _c(p["fds_per_rank"]), _c(p["threads_per_rank"]), _c(p["store_connections"])])
    text += markdown_table(headers, table)
    text += "\nElastic reset (the plane hora picks):\n\n"
    text += markdown_table(["ranks", "reset", "store ops per worker", "store load of the driver's ready passes"],
                           [[t["ranks"], _t(t["elastic"]["reset_s"]),
                             _c(t["elastic"].get("store_ops_reset_per_worker", 0.0)),
                             f"{t['elastic']['ready_pass_load']:.2f}"]
                            for t in projection["targets"]])
    text += "\nFitted counts (per rank unless total; n = ranks; exponent: growth from the two largest n measured):\n\n"
    rows = [[name, what, f["formula"], f"{f['exponent']:.2f}"] for name, fits in projection["fits"].items()
            for what, f in fits.items()]
    text += markdown_table(["plane", "quantity", "fit", "exponent"], rows)
    text += "\nWhere it breaks (the smallest rank count crossing each limit):\n\n"
    text += markdown_table(["ranks", "plane", "limit"], [[x["ranks"], x["setup"], x["what"]]
                                                         for x in projection["limits"]])
    first = projection["first_limit"]
    if first:
        text += f"\nFirst ({first['setup']}): **{first['what']} at {first['ranks']} ranks**.\n"
    return text
