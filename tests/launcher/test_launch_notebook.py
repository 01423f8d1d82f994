"""A real Jupyter notebook (nbclient + ipykernel) trains a small model on 2 ranks through ``hora.run``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "hora_run_training.ipynb"


def test_notebook_trains_with_hora_run(tmp_path: Path) -> None:
    path = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, path)
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(out.get("text", "") for out in nb.cells[-1].outputs if out.get("output_type") == "stream")
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) on 2 ranks", text)
    assert match, text
    first, last = float(match.group(1)), float(match.group(2))
    assert last < first / 100, text  # y = X @ [0..7]: SGD gets close to the noise floor
    weights = [float(w) for w in re.search(r"weights \[(.*)\]", text).group(1).split(",")]  # type: ignore[union-attr]
    assert weights == pytest.approx([0, 1, 2, 3, 4, 5, 6, 7], abs=0.1)
