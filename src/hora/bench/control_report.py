"""What ``hora bench control`` reports: one summary row per job from its ranks' counts, the Markdown tables
and the log-log plot of each quantity against the number of ranks.

Per rank figures are means over the ranks (the spread is in the JSON, rank by rank); totals are sums over
the ranks. A *message* is a TCP data segment: a control frame of a few hundred bytes is one.

Example:
    >>> _mean([1, 2, 3]), _median([3, 1, 2])
    (2.0, 2)
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hora.bench.report import markdown_table
from hora.engine.transport.plane import AUTO_PLANE

__all__ = ["at", "compact", "markdown", "plot", "summarize_elastic", "summarize_fixed"]


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def _store(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Store counts of several ranks (each ``{"ops", "keys", "bytes_out", "bytes_in", "by_family", "by_op"}``)."""
    families: Counter[str] = Counter()
    ops: Counter[str] = Counter()
    for r in records:
        families.update(r["by_family"])
        ops.update(r["by_op"])
    n = len(records) or 1
    return {"per_rank": _mean(r["ops"] for r in records), "max": max((r["ops"] for r in records), default=0),
            "total": sum(r["ops"] for r in records), "keys_per_rank": _mean(r["keys"] for r in records),
            "bytes_total": sum(r["bytes_out"] + r["bytes_in"] for r in records),
            "by_family_per_rank": {k: v / n for k, v in sorted(families.items())},
            "by_op_per_rank": {k: v / n for k, v in sorted(ops.items())}}


def _census(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"fds_per_rank": _mean(c["fds_total"] for c in records), "fds_max": max(c["fds_total"] for c in records),
            "peer_sockets_per_rank": _mean(c["fds"].get("tcp-peer", 0) for c in records),
            "threads_per_rank": _mean(c["threads_total"] for c in records),
            "threads_max": max(c["threads_total"] for c in records),
            "private_mb_per_rank": _mean(c["private_kb"] for c in records) / 1024,
            "fds_by_kind_rank0": records[0]["fds"], "threads_rank0": records[0]["threads"],
            "py_threads_rank0": records[0]["py_threads"]}


def _per_op(server_cpu: float | None, ops: float) -> float | None:
    return server_cpu / ops if server_cpu is not None and ops else None


def _phase(n: int, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One rounds phase (cold or warm) of every rank."""
    rounds = records[0]["rounds"] or 1
    peers = [r["peer"] for r in records]
    store = _store([r["store"] for r in records])
    return {"ops": records[0]["ops"], "rounds": records[0]["rounds"],
            "rounds_agree": len({r["rounds"] for r in records}) == 1,
            "exact": all(r["wrong"] == 0 for r in records),
            "msgs_out_per_rank": _mean(p["segs_out"] for p in peers) / rounds,
            "msgs_in_per_rank": _mean(p["segs_in"] for p in peers) / rounds,
            "msgs_per_rank": _mean(p["segs_out"] + p["segs_in"] for p in peers) / rounds,
            "bytes_per_rank": _mean(p["bytes_out"] + p["bytes_in"] for p in peers) / rounds,
            "msgs_total": sum(p["segs_out"] for p in peers) / rounds,
            "peers_talked_per_rank": _mean(r["talked"] for r in records),
            "bytes_total": sum(p["bytes_out"] for p in peers) / rounds,
            "store_ops_total": store["total"] / rounds,
            "store_between": sum(r["store_between"] for r in records),
            "wall_per_op_s": _median(r["wall_s"] / r["ops"] for r in records),
            "cpu_per_round_s": _mean(r["cpu_s"] for r in records) / rounds,
            "server_cpu_per_op_s": _per_op(records[0].get("server_cpu_s"), store["total"] + 2 * n)}


def _init(n: int, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    store = _store([r["store"] for r in records])
    peers = [r["peer"] for r in records]
    return {"wall_s": max(r["ended"] for r in records) - min(r["began"] for r in records),
            "rank_wall_s": _median(r["ended"] - r["began"] for r in records),
            "cpu_s": _mean(r["cpu_s"] for r in records), "store": store,
            "peer_msgs_per_rank": _mean(p["segs_out"] + p["segs_in"] for p in peers),
            "peer_bytes_per_rank": _mean(p["bytes_out"] + p["bytes_in"] for p in peers),
            "census": _census([r["census"] for r in records]),
            "server_cpu_per_op_s": _per_op(records[0].get("server_cpu_s"), store["total"] + 2 * n)}


def summarize_fixed(n: int, plane: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary row of a fixed job's ``records`` (one per rank, in rank order)."""
    built = {str(r.get("plane", "")) for r in records}  # what init() built (older records: what "auto" picks)
    used = {"Mesh": "tcp", "GlooPlane": "gloo"}.get(built.pop(), "") if len(built) == 1 else ""
    used = used or (plane if plane != "auto" else AUTO_PLANE)
    shutdown = [r["shutdown"] for r in records]
    return {"ranks": n, "plane": used, "asked": plane, "init": _init(n, [r["init"] for r in records]),
            "cold": _phase(n, [r["cold"] for r in records]), "warm": _phase(n, [r["warm"] for r in records]),
            "shutdown": {"store": _store([s["store"] for s in shutdown]),
                         "rank_wall_s": _median(s["wall_s"] for s in shutdown),
                         "fds_left_per_rank": _mean(s["left"]["fds_total"] for s in shutdown),
                         "threads_left_per_rank": _mean(s["left"]["threads_total"] for s in shutdown),
                         "fds_left_collected_per_rank": _mean(s["left_collected"]["fds_total"] for s in shutdown),
                         "threads_left_collected_per_rank": _mean(s["left_collected"]["threads_total"]
                                                                  for s in shutdown)}}


def summarize_elastic(n: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary row of an elastic job: ``records[0]`` is the driver's, the rest the workers'."""
    driver, workers = records[0], records[1:]
    resets = [w["reset"] for w in workers]
    return {"ranks": n, "plane": AUTO_PLANE,
            "init": _init(n, [w["init"] for w in workers]),
            "driver": {"init": driver["init"], "reset": driver["reset"]},
            "reset": {"store": _store([r["store"] for r in resets]),
                      "wall_s": max(r["ended"] for r in resets) - min(r["began"] for r in resets),
                      "rank_wall_s": _median(r["ended"] - r["began"] for r in resets),
                      "cpu_s": _mean(r["cpu_s"] for r in resets),
                      "fds_added_per_rank": _mean(r["census"]["fds_total"] for r in resets),
                      "threads_added_per_rank": _mean(r["census"]["threads_total"] for r in resets),
                      "fds_added_collected_per_rank": _mean(r["census_collected"]["fds_total"] for r in resets),
                      "threads_added_collected_per_rank": _mean(r["census_collected"]["threads_total"]
                                                                for r in resets),
                      "worlds": sorted({r["world"] for r in resets}),
                      "server_cpu_per_op_s": _per_op(resets[0].get("server_cpu_s"),
                                                     sum(r["store"]["ops"] for r in resets)
                                                     + driver["reset"]["store"]["ops"] + 2 * n)},
            "exact": all(all(w["checked"]) for w in workers)}


def compact(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with each job's per-rank records replaced by lists, rank by rank, of the counts that vary
    between ranks, and the key patterns of its store operations summed over the ranks (what a results
    directory keeps: the full per-rank records of 128 ranks weigh megabytes)."""
    rows = []
    for row in record["rows"]:
        row = dict(row)
        per = row.pop("per_rank", None)
        if per:
            row["rank_by_rank"] = _rank_by_rank(row["job"], per)
        rows.append(row)
    return {**record, "rows": rows}


def _patterns(stores: Iterable[dict[str, Any]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for store in stores:
        total.update(store.get("patterns", {}))
    return dict(sorted(total.items()))


def _rank_by_rank(job: str, per: list[dict[str, Any]]) -> dict[str, Any]:
    if job == "elastic":
        driver, workers = per[0], per[1:]
        return {"init_store_ops": [w["init"]["store"]["ops"] for w in workers],
                "reset_store_ops": [w["reset"]["store"]["ops"] for w in workers],
                "reset_wall_s": [round(w["reset"]["ended"] - w["reset"]["began"], 4) for w in workers],
                "init_patterns": _patterns(w["init"]["store"] for w in workers),
                "reset_patterns": _patterns(w["reset"]["store"] for w in workers),
                "driver": {"init": {k: v for k, v in driver["init"].items()},
                           "reset": {k: v for k, v in driver["reset"].items()}}}
    out: dict[str, Any] = {
        "init_store_ops": [r["init"]["store"]["ops"] for r in per],
        "init_wall_s": [round(r["init"]["ended"] - r["init"]["began"], 4) for r in per],
        "init_cpu_s": [round(r["init"]["cpu_s"], 4) for r in per],
        "fds": [r["init"]["census"]["fds_total"] for r in per],
        "threads": [r["init"]["census"]["threads_total"] for r in per],
        "init_patterns": _patterns(r["init"]["store"] for r in per),
        "shutdown_left_collected": [r["shutdown"]["left_collected"]["fds_total"] for r in per]}
    for phase in ("cold", "warm"):
        out[f"{phase}_rounds"] = [r[phase]["rounds"] for r in per]
        out[f"{phase}_segs_out"] = [r[phase]["peer"]["segs_out"] for r in per]
        out[f"{phase}_bytes_out"] = [r[phase]["peer"]["bytes_out"] for r in per]
        out[f"{phase}_cpu_s"] = [round(r[phase]["cpu_s"], 4) for r in per]
        out[f"{phase}_store_patterns"] = _patterns(r[phase]["store"] for r in per)
    return out


# --- the tables ---------------------------------------------------------------------------------------------
def _n(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 or x == int(x) else f"{x:.1f}"


def _s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.1f} s"


def markdown(record: dict[str, Any]) -> str:
    rows = [r for r in record["rows"] if "error" not in r]
    fixed = [r for r in rows if r["job"].startswith("fixed")]
    elastic = [r for r in rows if r["job"] == "elastic"]
    m = record.get("machine", {})
    text = (f"{m.get('started_utc', '?')} to {m.get('ended_utc', '?')}: {m.get('cpus', '?')} x {m.get('cpu', '?')}, "
            f"{m.get('memory_gib', '?')} GiB, torch {m.get('torch', '?')}, hora {m.get('hora', '?')}; "
            f"{record['config']['ops']} allreduces per rounds phase.\n\n" if m else "")
    text += ("Counts are exact (messages: TCP data segments on the connections between ranks; store: operations "
            "on the rendezvous store, torch's included), per rank (mean over ranks) unless marked total. Times "
            "are wall clock on this machine, with the 1-minute load average at the start and end of each job.\n\n")
    headers = ["ranks", "plane", "msgs/rank/round warm (cold)", "bytes/rank/round warm (cold)", "peers talked to",
               "rounds/op warm", "store ops/round (total)", "store ops/rank at init (total)", "peer sockets/rank",
               "fds/rank", "threads/rank", "init", "round warm (cold)", "load"]
    table = []
    for r in fixed:
        i, w, c = r["init"], r["warm"], r["cold"]
        table.append([r["ranks"], r["plane"], f"{_n(w['msgs_per_rank'])} ({_n(c['msgs_per_rank'])})",
                      f"{_n(w['bytes_per_rank'])} ({_n(c['bytes_per_rank'])})", _n(w["peers_talked_per_rank"]),
                      f"{w['rounds'] / w['ops']:.2f}", _n(w["store_ops_total"]),
                      f"{_n(i['store']['per_rank'])} ({_n(i['store']['total'])})",
                      _n(i["census"]["peer_sockets_per_rank"]), _n(i["census"]["fds_per_rank"]),
                      _n(i["census"]["threads_per_rank"]), _s(i["wall_s"]),
                      f"{_s(w['wall_per_op_s'])} ({_s(c['wall_per_op_s'])})", f"{r['load'][0]:.0f}-{r['load'][1]:.0f}"])
    text += markdown_table(headers, table)
    families = sorted({f for r in fixed for f in r["init"]["store"]["by_family_per_rank"]})
    text += "\nStore operations per rank during `hora.init()`, by whose keys they name:\n\n"
    text += markdown_table(["ranks", "plane", *families],
                           [[r["ranks"], r["plane"], *(_n(r["init"]["store"]["by_family_per_rank"].get(f, 0))
                                                       for f in families)] for r in fixed])
    if elastic:
        text += ("\nElastic job: n workers and the driver's stand-in; world 1, then every worker resets into world 2 "
                 "(same workers). Workers wait in the store without polling; the driver's stand-in reads the ready "
                 "keys every tick, so its counts depend on how long it waits.\n\n")
        table = []
        for r in elastic:
            i, rs, d = r["init"], r["reset"], r["driver"]
            table.append([r["ranks"], f"{_n(i['store']['per_rank'])} ({_n(i['store']['total'])})",
                          f"{_n(rs['store']['per_rank'])} ({_n(rs['store']['total'])})",
                          f"{_n(rs['store']['keys_per_rank'])}",
                          f"{d['reset']['store']['ops']} ({d['reset']['passes']} passes)", _s(rs["wall_s"]),
                          f"{rs['fds_added_per_rank']:+.1f} / {rs['threads_added_per_rank']:+.1f} ("
                          f"{rs['fds_added_collected_per_rank']:+.1f} / {rs['threads_added_collected_per_rank']:+.1f})",
                          "yes" if r["exact"] else "NO", f"{r['load'][0]:.0f}-{r['load'][1]:.0f}"])
        text += markdown_table(["ranks", "store ops/worker at init (total)", "store ops/worker at reset (total)",
                                "keys named/worker at reset", "driver ops at reset", "reset", "fds / threads after "
                                "reset vs before (after gc.collect())", "exact", "load"], table)
    failed = [r for r in record["rows"] if "error" in r]
    for r in failed:
        text += f"\n**{r['job']} at {r['ranks']} ranks failed**: {r['error'].splitlines()[0]}\n"
    return text


def at(*path: str) -> Callable[[dict[str, Any]], float]:
    """A reader of the value at ``path`` in a summary row: ``at("warm", "msgs_per_rank")(row)``."""
    def read(row: dict[str, Any]) -> float:
        value: Any = row
        for key in path:
            value = value[key]
        return float(value)
    return read


# --- the plot -----------------------------------------------------------------------------------------------
def plot(record: dict[str, Any]) -> Callable[[Any], None]:
    """Each quantity against the number of ranks, log-log, one panel per kind of quantity."""
    rows = [r for r in record["rows"] if "error" not in r]

    def series(job: str, get: Callable[[dict[str, Any]], float]) -> tuple[list[int], list[float]]:
        chosen = [r for r in rows if r["job"] == job]
        return [r["ranks"] for r in chosen], [get(r) for r in chosen]

    fixed = sorted({r["job"] for r in rows if r["job"].startswith("fixed")})
    warm_cold = [(j, p) for j in fixed for p in ("warm", "cold")]
    panels: list[tuple[str, list[tuple[str, str, Callable[[dict[str, Any]], float]]]]] = [
        ("messages per rank per round", [(f"{j[6:]} {p}", j, at(p, "msgs_per_rank")) for j, p in warm_cold]),
        ("bytes per rank per round", [(f"{j[6:]} {p}", j, at(p, "bytes_per_rank")) for j, p in warm_cold]),
        ("store operations", [(f"{j[6:]} init, per rank", j, at("init", "store", "per_rank")) for j in fixed]
         + [(f"{j[6:]} init, total", j, at("init", "store", "total")) for j in fixed]
         + [("elastic reset, per worker", "elastic", at("reset", "store", "per_rank"))]),
        ("descriptors and threads per rank", [(f"{j[6:]} fds", j, at("init", "census", "fds_per_rank")) for j in fixed]
         + [(f"{j[6:]} threads", j, at("init", "census", "threads_per_rank")) for j in fixed]),
        ("wall time, s (CPU contention at large n)", [(f"{j[6:]} init", j, at("init", "wall_s")) for j in fixed]
         + [(f"{j[6:]} round warm", j, at("warm", "wall_per_op_s")) for j in fixed]
         + [("elastic reset", "elastic", at("reset", "wall_s"))]),
        ("CPU s per rank", [(f"{j[6:]} per warm round", j, at("warm", "cpu_per_round_s")) for j in fixed]
         + [(f"{j[6:]} init", j, at("init", "cpu_s")) for j in fixed]),
    ]

    def draw(fig: Any) -> None:
        for k, (title, lines) in enumerate(panels):
            ax = fig.add_subplot(2, 3, k + 1)
            first: tuple[list[int], list[float]] | None = None
            for label, job, get in lines:
                xs, ys = series(job, get)
                if xs and any(y > 0 for y in ys):
                    ax.plot(xs, ys, "o-", label=label, markersize=3)
                    first = first or (xs, ys)
            if k in (0, 2) and first is not None:  # guides: the growth of a count per rank today, and log n
                xs, ys = first
                ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "k--", linewidth=0.7, label="∝ n")
                ax.plot(xs, [ys[0] * math.log2(x) / math.log2(xs[0]) for x in xs], "k:", linewidth=0.9,
                        label="∝ log n")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks")
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)

    return draw
