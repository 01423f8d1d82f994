"""The README's quick start runs as printed: under `hora run -np 2`, with a toy dataset and model around it.

It is the code a new user copies: the sampler without `shuffle=True`, fp16 compression, the scaled learning
rate, the loss averaged over the ranks and logged and saved by rank 0 only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

AROUND = """\
import torch
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
Net = lambda: torch.nn.Linear(8, 3)
loss_fn = torch.nn.functional.cross_entropy
epochs = 2
"""


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quickstart"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_readme_quickstart_runs_logs_once_and_saves_once(tmp_path: Path) -> None:
    code = _quickstart()
    assert "shuffle=True" not in code.split("#")[0]  # the sampler shuffles
    script = tmp_path / "train.py"
    script.write_text(AROUND + code)
    proc = subprocess.run([sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    logged = [line for line in proc.stdout.splitlines() if ": loss " in line]
    assert len(logged) == 2 and all(line.startswith("[0]") for line in logged), proc.stdout  # rank 0's, per epoch
    assert [re.search(r"epoch (\d+)", line).group(1) for line in logged] == ["0", "1"]  # type: ignore[union-attr]
    assert (tmp_path / "model.pt").is_file()
    assert "error" not in proc.stderr.lower(), proc.stderr[-2000:]
