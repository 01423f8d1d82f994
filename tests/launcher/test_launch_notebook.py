"""A real Jupyter notebook (nbconvert + ipykernel) trains a small model on 2 ranks through ``hora.run``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("nbconvert")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "hora_run_training.ipynb"


def test_notebook_trains_with_hora_run(tmp_path: Path) -> None:
    """Executed as a user would from the command line: ``jupyter nbconvert --to notebook --execute``."""
    path = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, path)
    proc = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--ExecutePreprocessor.timeout=240", "--output", "executed.ipynb", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    nb = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    text = "".join(out.get("text", "") for out in nb.cells[-1].outputs if out.get("output_type") == "stream")
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) on 2 ranks", text)
    assert match, text
    first, last = float(match.group(1)), float(match.group(2))
    assert last < first / 100, text  # y = X @ [0..7]: SGD gets close to the noise floor
    weights = [float(w) for w in re.search(r"weights \[(.*)\]", text).group(1).split(",")]  # type: ignore[union-attr]
    assert weights == pytest.approx([0, 1, 2, 3, 4, 5, 6, 7], abs=0.1)
