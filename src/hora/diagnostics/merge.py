"""Per-rank timeline files: their names, reading them, and merging them into one file.

Merging streams each file's events into the output without parsing them (a rank's file of an hour-long run
can be gigabytes); only a file that does not end as a JSON array should (a disk that filled up mid-write)
is parsed, keeping every complete event.

    python -m hora.diagnostics merge-timeline t.json     # merge t.rank*.json into t.json
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import IO, Any

log = logging.getLogger(__name__)

_EDGE = 64  # bytes read at each end of a file to find its brackets


def rank_path(path: str, rank: int) -> str:
    """The file rank ``rank`` writes for a job timeline ``path``: ``t.json`` -> ``t.rank3.json``."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}" if ext else f"{path}.rank{rank}"


def rank_parts(path: str) -> list[str]:
    """The per-rank files of ``path`` that exist (``t.rank0.json``, ``t.rank1.json``...), in rank order."""
    root, ext = os.path.splitext(path)
    base = f"{root}.rank" if ext else f"{path}.rank"
    found = []
    for p in glob.glob(glob.escape(base) + "*" + ext):
        middle = p[len(base): len(p) - len(ext)] if ext else p[len(base):]
        if middle.isdigit():
            found.append((int(middle), p))
    return [p for _, p in sorted(found)]


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
    """Merge per-rank timeline files into ``out_path`` (written atomically). Missing files are skipped.

    Returns:
        The number of files whose events were merged.
    """
    tmp = out_path + ".tmp"
    merged = 0
    with open(tmp, "wb") as out:
        out.write(b"[\n")
        for p in paths:
            if not os.path.exists(p):
                log.warning("timeline %s is missing (that rank never started its timeline?)", p)
                continue
            merged += _copy_events(p, out, first=merged == 0)
        out.write(b"\n]\n")
    os.replace(tmp, out_path)
    return merged


def finish_job_timeline(path: str, size: int, remove_parts: bool = True) -> str:
    """At job end (launcher): merge ``rank_path(path, r)`` for every rank into ``path``; returns ``path``.

    With one rank the worker already wrote ``path`` itself and nothing is done.
    """
    if size <= 1:
        return path
    parts = [rank_path(path, r) for r in range(size)]
    n = merge_timelines(parts, path)
    if remove_parts:
        for p in parts:
            if os.path.exists(p):
                os.remove(p)
    log.info("timeline: %d of %d ranks -> %s", n, size, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Merge ``t.rank*.json`` into ``t.json`` (for timelines started at run time, which no launcher merges)."""
    ap = argparse.ArgumentParser(prog="python -m hora.diagnostics merge-timeline", description=main.__doc__)
    ap.add_argument("path", help="the timeline path given to start_timeline / --timeline-filename")
    ap.add_argument("--keep-parts", action="store_true", help="keep the per-rank files")
    args = ap.parse_args(argv)
    parts = rank_parts(args.path)
    if not parts:
        sys.stderr.write(f"no per-rank files {rank_path(args.path, 0)}, ... next to {args.path}\n")
        return 1
    n = merge_timelines(parts, args.path)
    if not args.keep_parts:
        for p in parts:
            os.remove(p)
    sys.stderr.write(f"events of {n} ranks -> {args.path}\n")
    return 0
