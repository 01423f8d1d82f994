"""docs/api.md is generated from the docstrings and cannot go stale; every public name is documented."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api_doc", ROOT / "scripts" / "gen_api_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date() -> None:
    gen = _generator()
    assert (ROOT / "docs" / "api.md").read_text() == gen.render(), (
        "docs/api.md is stale: run python scripts/gen_api_doc.py")


def test_every_public_name_has_a_docstring_and_a_section() -> None:
    gen = _generator()
    text = gen.render()
    for name, obj in gen.public_names().items():
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"hora.{name} has no docstring"
        assert f"`{name}" in text, name
    assert "\n## hora." not in text, "a public name's module has no section title in scripts/gen_api_doc.py"
