"""hora's core stays light (no cluster framework, Ray or Spark, imported with it), and a framework that is not
installed is named with the extra that brings it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_hora_imports_no_framework() -> None:
    out = subprocess.run([sys.executable, "-c", "import hora, sys; print(sorted(m for m in ('ray', 'pyspark') "
                          "if m in sys.modules))"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("package", "framework", "extra"), [("hora.ray", "ray", "ray"),
                                                          ("hora.spark", "pyspark", "spark")])
def test_a_missing_framework_names_the_extra_to_install(package: str, framework: str, extra: str) -> None:
    code = (f"import sys; sys.modules[{framework!r}] = None\n"  # as if not installed
            f"try:\n    import {package}\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert f"{package} needs {framework}, which is not installed" in out.stdout
    assert f"pip install 'hora[{extra}]'" in out.stdout
