"""Per-rank timeline files: their names, reading them, and merging them into one file.

A rank's file carries its job's id when it has one (``t.<job>.rank3.json``; every job of ``hora run`` has
one), so two jobs given the same timeline path never write into each other's rank files, and each job merges
only its own. Merging streams each file's events into the output without parsing them (a rank's file of an
hour-long run can be gigabytes); only a file that does not end as a JSON array should (a disk that filled up
mid-write) is parsed, keeping every complete event. The merged file is written next to the target and renamed
over it only when it holds events: a merge that found none, or failed half-way (a full disk), leaves an
existing file as it was and no temporary file behind.

    python -m hora.diagnostics merge-timeline t.json     # merge t.rank*.json (or t.<job>.rank*.json) into t.json
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import IO, Any

log = logging.getLogger(__name__)

_EDGE = 64  # bytes read at each end of a file to find its brackets


def job_tag(job: str) -> str:
    """A job id as it appears in file names (``"run/attempt0"`` -> ``"run-attempt0"``)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", job).strip("-")


def rank_path(path: str, rank: int, job: str = "") -> str:
    """The file rank ``rank`` of job ``job`` writes for a timeline ``path``: ``t.json`` -> ``t.<job>.rank3.json``
    (``t.rank3.json`` without a job id)."""
    root, ext = os.path.splitext(path)
    tag = f".{job_tag(job)}" if job_tag(job) else ""
    return f"{root}{tag}.rank{rank}{ext}" if ext else f"{path}{tag}.rank{rank}"


_PART = re.compile(r"(?:([A-Za-z0-9_-]+)\.)?rank(\d+)")


def rank_groups(path: str) -> dict[str, list[str]]:
    """The per-rank files of ``path`` that exist, by job id (``""``: files without one), each in rank order."""
    root, ext = os.path.splitext(path)
    base = f"{root}." if ext else f"{path}."
    found: dict[str, list[tuple[int, str]]] = {}
    for p in glob.glob(glob.escape(base) + "*" + ext):
        middle = p[len(base): len(p) - len(ext)] if ext else p[len(base):]
        m = _PART.fullmatch(middle)
        if m:
            found.setdefault(m.group(1) or "", []).append((int(m.group(2)), p))
    return {job: [p for _, p in sorted(parts)] for job, parts in found.items()}


def rank_parts(path: str, job: str | None = None) -> list[str]:
    """The per-rank files of ``path`` that exist (``t.rank0.json``, ``t.rank1.json``...), in rank order: of job
    ``job`` (``""``: the files without a job id), or of every job when None."""
    groups = rank_groups(path)
    if job is not None:
        return groups.get(job_tag(job), [])
    return [p for parts in groups.values() for p in parts]


def load_events(path: str) -> list[dict[str, Any]]:
    """The events of a timeline file; a file cut short keeps every complete event (one per line)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        events = json.loads(text)
    except json.JSONDecodeError:
        events = []
        for line in text.splitlines():
            line = line.strip().lstrip("[").rstrip(",]").strip()
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    if isinstance(events, list):
        return events
    raise TypeError(f"{path} is not a Chrome-trace timeline (expected a JSON array of events)")


def _inner(f: IO[bytes]) -> tuple[int, int] | None:
    """Byte range between a file's opening ``[`` and closing ``]``, or None if it is not so framed."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    head = f.read(min(size, _EDGE))
    f.seek(max(size - _EDGE, 0))
    tail = f.read()
    if not head.lstrip().startswith(b"[") or not tail.rstrip().endswith(b"]"):
        return None
    start = head.index(b"[") + 1
    end = size - len(tail) + tail.rindex(b"]")
    f.seek(start)
    if end <= start or not f.read(min(end - start, _EDGE)).strip():
        return (start, start)  # an empty array
    return (start, end)


def _copy_events(src: str, out: IO[bytes], first: bool) -> bool:
    """Append ``src``'s events to ``out``; returns whether anything was written."""
    with open(src, "rb") as f:
        span = _inner(f)
        if span is None:  # not a complete array: parse what is there
            events = load_events(src)
            if not events:
                return False
            body = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events).encode()
            out.write((b"" if first else b",\n") + body)
            return True
        start, end = span
        if end == start:
            return False
        out.write(b"" if first else b",\n")
        f.seek(start)
        remaining = end - start
        while remaining > 0:
            chunk = f.read(min(remaining, 1 << 20))
            if not chunk:
                break
            out.write(chunk)  # raw bytes: the whitespace around events is valid JSON as it stands
            remaining -= len(chunk)
    return True


def merge_timelines(paths: Sequence[str], out_path: str) -> int:
    """Merge per-rank timeline files into ``out_path``. Missing files are skipped.

    The result is written to a temporary file in the same directory and renamed over ``out_path`` only when at
    least one file contributed events: an existing ``out_path`` is never replaced by an empty timeline. A failure
    (a full disk) leaves no temporary file and ``out_path`` as it was.

    Returns:
        The number of files whose events were merged (0: ``out_path`` was not written).
    """
    folder = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out_path)}.", suffix=".tmp", dir=folder)
    merged = 0
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(b"[\n")
            for p in paths:
                if not os.path.exists(p):
                    log.warning("timeline %s is missing (that rank never started its timeline?)", p)
                    continue
                merged += _copy_events(p, out, first=merged == 0)
            out.write(b"\n]\n")
        if merged:
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return merged


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def finish_job_timeline(path: str, size: int, remove_parts: bool = True, job: str = "") -> int:
    """At job end (launcher): merge ``rank_path(path, r, job)`` for every rank into ``path``; returns how many
    ranks' files held events (0: ``path`` was left as it was).

    With one rank the worker already wrote ``path`` itself and nothing is done (returns 1).
    """
    if size <= 1:
        return 1
    parts = [rank_path(path, r, job) for r in range(size)]
    n = merge_timelines(parts, path)
    if remove_parts:
        for p in parts:
            if os.path.exists(p):
                os.remove(p)
    log.info("timeline: %d of %d ranks -> %s", n, size, path)
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """Merge ``t.rank*.json`` into ``t.json`` (for timelines started at run time, which no launcher merges)."""
    ap = argparse.ArgumentParser(prog="python -m hora.diagnostics merge-timeline", description=main.__doc__)
    ap.add_argument("path", help="the timeline path given to start_timeline / --timeline-filename")
    ap.add_argument("--keep-parts", action="store_true", help="keep the per-rank files")
    ap.add_argument("--job", help="merge the files of this job id (when several jobs left files next to PATH)")
    args = ap.parse_args(argv)
    groups = rank_groups(args.path)
    if args.job is not None:
        groups = {job: parts for job, parts in groups.items() if job == job_tag(args.job)}
    if not groups:
        sys.stderr.write(f"no per-rank files {rank_path(args.path, 0)}, ... next to {args.path}\n")
        return 1
    if len(groups) > 1:
        jobs = ", ".join(job or "(none)" for job in sorted(groups))
        sys.stderr.write(f"per-rank files of several jobs next to {args.path} (job ids: {jobs}); merge one job's "
                         "with --job ID\n")
        return 1
    parts = next(iter(groups.values()))
    n = merge_timelines(parts, args.path)
    if not n:
        sys.stderr.write(f"no events in {', '.join(parts)}; {args.path} not written\n")
        return 1
    if not args.keep_parts:
        for p in parts:
            os.remove(p)
    sys.stderr.write(f"events of {n} ranks -> {args.path}\n")
    return 0
