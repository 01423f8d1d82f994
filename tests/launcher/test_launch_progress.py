"""A real tqdm progress bar under ``hora run``: live in a (pseudo-)terminal, plain lines in a file.

In a terminal each bar has one line, redrawn in place, its final state stays before the rank's next line,
and a ``leave=False`` bar leaves nothing; the final screen is read back through a small terminal model.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher.helpers import HORA, PYTHON, write_script

pytest.importorskip("tqdm")

BARS = """
import os, sys, time
from tqdm import tqdm
r = int(os.environ["HORA_RANK"])
for _ in tqdm(range(40), desc=f"kept{r}", mininterval=0, ncols=70):       # leave=True: its last state stays
    time.sleep(0.02)
for _ in tqdm(range(40), desc=f"gone{r}", mininterval=0, ncols=70, leave=False):  # erases itself
    time.sleep(0.02)
print(f"result {r}", flush=True)
"""
_CSI = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def screen_of(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: handles \\r, \\n, ESC[2K (clear line) and ESC[nA (cursor up)."""
    lines, row, col, i = [""], 0, 0, 0
    while i < len(raw):
        ch = raw[i]
        m = _CSI.match(raw, i)
        if m:
            if m.group(2) == "K":
                lines[row] = ""
            elif m.group(2) == "A":
                row = max(0, row - int(m.group(1) or 1))
            i = m.end()
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1:]
            col += 1
        i += 1
    return [ln.rstrip() for ln in lines if ln.strip()]


def _run_in_pty(args: list[str], cwd: Path, timeout: float = 90) -> tuple[int, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    code = proc.wait(timeout=10)
    return code, b"".join(chunks).decode(errors="replace")


def test_bars_are_live_lines_in_a_terminal(tmp_path: Path) -> None:
    script = write_script(tmp_path, "bars.py", BARS)
    code, raw = _run_in_pty([*HORA, "run", "-np", "2", PYTHON, script], tmp_path)
    assert code == 0, raw[-3000:]
    screen = screen_of(raw)
    for r in range(2):
        kept = [i for i, ln in enumerate(screen) if f"kept{r}" in ln]
        assert len(kept) == 1, screen  # one line per bar, redrawn in place
        assert re.search(rf"^\[{r}\]<stderr>:kept{r}: 100%.*40/40", screen[kept[0]]), screen
        result = screen.index(f"[{r}]<stdout>:result {r}")
        assert kept[0] < result, screen  # the bar's final state comes before the rank's next line
    assert not [ln for ln in screen if "gone" in ln], screen  # leave=False: nothing left
    assert "\x1b[2K" in raw  # it was drawn live, in place


def test_bars_are_plain_lines_when_not_a_terminal(tmp_path: Path) -> None:
    script = write_script(tmp_path, "bars.py", BARS)
    proc = subprocess.run(f"{' '.join(HORA)} run -np 2 {PYTHON} {script} 2>&1", shell=True, cwd=tmp_path,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout  # no terminal codes in a file or a pipe
    for r in range(2):
        kept = [i for i, ln in enumerate(lines) if ln.startswith(f"[{r}]<stderr>:kept{r}: 100%")]
        assert len(kept) == 1, lines  # the final state, once, as a line
        states = [ln for ln in lines if ln.startswith(f"[{r}]<stderr>:kept{r}")]
        assert len(states) <= 5, states  # thinned to about one a second (0.8 s of bar)
        assert kept[0] < lines.index(f"[{r}]<stdout>:result {r}"), lines
        assert all(i < lines.index(f"[{r}]<stdout>:result {r}")
                   for i, ln in enumerate(lines) if ln.startswith(f"[{r}]<stderr>:gone{r}")), lines
