"""Run one benchmark script from two git commits, alternating in one run, and print new/old ratios.

Each commit is checked out in a temporary ``git worktree`` (removed at the end) and its script runs with this
interpreter (the same venv, so the same torch) and ``PYTHONPATH=<worktree>/src``, so the commit's own hora is
imported (each run says which file it imported). Runs alternate old new new old ... (ABBA: a drift of the
machine's load over the run falls on both sides alike); every run writes its JSON report to a temporary
directory and the figures a user cares about (hora's times, lower is better) are read from it. For each
figure it prints the median over the runs of each side and the ratio new/old: below 1 the new commit is
faster. Raw torch.distributed and DDP figures are printed too: their ratio is the A/A control (the same code
on both sides), so a hora ratio inside the control's distance from 1 is noise, not a change. On a loaded
machine the last column is the one to read: each run's hora figure divided by the control measured beside it
in the same run (hora/raw, hora/DDP), then new/old of those, which cancels the load common to both.

    .venv/bin/python benchmarks/compare_commits.py --old 5d0b6dd op_overhead.py
    .venv/bin/python benchmarks/compare_commits.py --old 5d0b6dd allreduce_bench.py --sizes 1MB,4MB,16MB
    .venv/bin/python benchmarks/compare_commits.py --old 5d0b6dd --rounds 1 optimizer_bench.py --repeats 10

Arguments after the script's name go to the script (``--out`` is added). ``--new`` defaults to HEAD
(committed work only: commit what you want measured). ``--out DIR`` also writes the table
(``compare_commits.md``) and every run's figures (``compare_commits.json``); ``--quick`` is a smoke run.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
Figures = dict[str, float]


def _op_overhead(data: dict[str, Any]) -> Figures:
    return {f"{k} us/call": v for k, v in data["per_call_us"].items()}


def _allreduce_bench(data: dict[str, Any]) -> Figures:
    out: Figures = {}
    for row in data["result"]["rows"]:
        size = _size(row["bytes"])
        for variant in ("raw", "hora", "hora_oop", "raw_oop"):
            if f"{variant}_s" in row:
                out[f"{size} {variant} ms"] = row[f"{variant}_s"] * 1e3
    for key, value in data["result"].get("tiny", {}).items():
        if key.endswith("_us"):
            out[f"1-element {key[:-3]} us"] = value
    return out


def _optimizer_bench(data: dict[str, Any]) -> Figures:
    walls = data["samples_s"][0]["wall"]  # rank 0's step times per variant
    return {f"{variant} ms/step": statistics.median(samples) * 1e3 for variant, samples in walls.items() if samples}


def _leaves(data: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Numbers under keys that end in _s / _us / _ms (any other script's report: its times)."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, f"{path}/{key}")
    elif isinstance(data, (int, float)) and not isinstance(data, bool) and path.endswith(("_s", "_us", "_ms")):
        yield path.lstrip("/"), float(data)


EXTRACTORS: dict[str, Callable[[dict[str, Any]], Figures]] = {
    "op_overhead": _op_overhead,
    "allreduce_bench": _allreduce_bench,
    "optimizer_bench": _optimizer_bench,
}
CONTROLS = ("raw", "ddp", "local", "per_tensor")  # the same code on both sides: their ratio is the noise band


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def figures(script: str, data: dict[str, Any]) -> Figures:
    """The figures compared for ``script`` (its file name's stem picks the reader)."""
    reader = EXTRACTORS.get(Path(script).stem)
    return reader(data) if reader is not None else dict(_leaves(data))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def _run_once(tree: Path, script: str, args: list[str], out: Path) -> Figures:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")])}
    which = subprocess.run([sys.executable, "-c", "import hora; print(hora.__file__)"], env=env, cwd=tree,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not which.startswith(str(tree)):
        raise SystemExit(f"compare_commits: the run in {tree} imported hora from {which}, not from the commit")
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--out", str(out)]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"compare_commits: `{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    reports = sorted(out.glob("*.json"))
    if not reports:
        raise SystemExit(f"compare_commits: {script} wrote no JSON report into {out}")
    return figures(script, json.loads(reports[0].read_text()))


def control_of(key: str, figures: Figures) -> str | None:
    """The control figure measured beside ``key`` in the same run (``1MB hora ms`` -> ``1MB raw ms``), or None."""
    words = key.split()
    for i, word in enumerate(words):
        if word in CONTROLS:
            return None  # a control itself
        for control in CONTROLS:
            candidate = " ".join([*words[:i], control, *words[i + 1:]])
            if candidate != key and candidate in figures:
                return candidate
    return None


def _table(old: list[Figures], new: list[Figures]) -> list[tuple[str, float, float, float, float | None]]:
    """Per figure: old and new medians, new/old, and new/old of the figure divided by its same-run control."""
    rows = []
    for key in old[0]:
        a = [f[key] for f in old if key in f]
        b = [f[key] for f in new if key in f]
        if not (a and b and statistics.median(a) > 0):
            continue
        normalized = None
        control = control_of(key, old[0])
        if control is not None:
            a_rel = [f[key] / f[control] for f in old if key in f and f.get(control)]
            b_rel = [f[key] / f[control] for f in new if key in f and f.get(control)]
            if a_rel and b_rel:
                normalized = statistics.median(b_rel) / statistics.median(a_rel)
        rows.append((key, statistics.median(a), statistics.median(b), statistics.median(b) / statistics.median(a),
                     normalized))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the baseline commit (any git revision)")
    p.add_argument("--new", default="HEAD", help="the commit to judge (default HEAD)")
    p.add_argument("--rounds", type=int, default=2, help="runs per commit, alternating ABBA (default 2)")
    p.add_argument("--quick", action="store_true", help="one run per commit, the script's own --quick settings "
                   "(a smoke run: checks that both commits run, says nothing about speed)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write compare_commits.json (every run's figures) and compare_commits.md here")
    p.add_argument("script", help="a script in benchmarks/, e.g. op_overhead.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = p.parse_args(argv)
    script_args = [*args.script_args, "--quick"] if args.quick else list(args.script_args)
    rounds = 1 if args.quick else args.rounds
    commits = {"old": _git("rev-parse", "--short", args.old), "new": _git("rev-parse", "--short", args.new)}
    results: dict[str, list[Figures]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="hora-compare-") as tmp:
        trees = {side: Path(tmp) / side for side in commits}
        for side, commit in commits.items():
            _git("worktree", "add", "--detach", str(trees[side]), commit)
        try:
            order = [side for r in range(rounds) for side in (("old", "new") if r % 2 == 0 else ("new", "old"))]
            for i, side in enumerate(order):
                t0 = time.monotonic()
                results[side].append(_run_once(trees[side], args.script, script_args, Path(tmp) / f"out{i}"))
                sys.stderr.write(f"run {i + 1}/{len(order)}: {side} ({commits[side]}) "
                                 f"{time.monotonic() - t0:.0f} s\n")
        finally:
            for tree in trees.values():
                _git("worktree", "remove", "--force", str(tree))
    rows = _table(results["old"], results["new"])
    load = os.getloadavg()[0]
    head = (f"{args.script} {' '.join(script_args)}: new {commits['new']} / old {commits['old']}, {rounds} run(s) "
            f"each, alternating; load average {load:.1f}")
    lines = [head, "", "| figure | old | new | new/old | new/old, each run's figure / its control |",
             "|---|---|---|---|---|"]
    for key, a, b, ratio, normalized in rows:
        if any(word in CONTROLS for word in key.split()):
            lines.append(f"| {key} | {a:.3f} | {b:.3f} | {ratio:.3f} (control) | |")
            continue
        relative = f"{normalized:.3f} (vs {control_of(key, results['old'][0])})" if normalized is not None else ""
        lines.append(f"| {key} | {a:.3f} | {b:.3f} | {ratio:.3f} | {relative} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare_commits.md").write_text(text)
        (args.out / "compare_commits.json").write_text(json.dumps(
            {"commits": commits, "script": args.script, "args": script_args, "load_avg_1m": load, "runs": results,
             "ratios": {k: r for k, _, _, r, _ in rows},
             "ratios_vs_control": {k: n for k, _, _, _, n in rows if n is not None}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
