"""Regenerate docs/api.md, the API reference, from the docstrings of hora's public names.

    python scripts/gen_api_doc.py           # write docs/api.md
    python scripts/gen_api_doc.py --check   # exit 1 when docs/api.md is stale (the test suite does this too)

Public names are those ``import hora`` exposes without a leading underscore; they are grouped by the module
that defines them, in the order of :data:`SECTIONS`.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import hora

OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"
# defining module -> section title, in the order the reference shows them
SECTIONS: dict[str, str] = {
    "hora.runtime.lifecycle": "Start, stop and topology",
    "hora.common.process_sets": "Process sets",
    "hora.api.ops": "Collectives",
    "hora.api.grouped": "Grouped collectives",
    "hora.api.sparse": "Sparse allreduce",
    "hora.engine.scheduling.handles": "Asynchronous handles",
    "hora.datapath.reduce_ops": "Reduction operations",
    "hora.training.optimizer": "DistributedOptimizer",
    "hora.api.functions": "Broadcast and gather helpers",
    "hora.datapath.wire": "Compression",
    "hora.training.sync_batch_norm": "SyncBatchNorm",
    "hora.diagnostics.timeline": "Timeline",
    "hora.launcher.pyfunc.run": "Launching from Python",
    "hora.api.build_info": "Build queries",
    "hora.errors": "Errors",
}
HEADER = """# API reference

Every public name of `import hora as hvd` (the same names as `import horovod.torch as hvd` under
`hora run`), with its signature and docstring. Generated from the source by `python scripts/gen_api_doc.py`;
a test fails when this file is out of date. Guides: [README](../README.md), [launcher](launcher.md),
[optimizer](optimizer.md), [collectives](collectives.md), [diagnostics](diagnostics.md).
"""
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_QUOTED = re.compile(r"(: |-> )'([^']*)'")


def public_names() -> dict[str, Any]:
    """name -> object for everything ``import hora`` exposes (no modules, no ``__future__`` feature)."""
    named = {name: getattr(hora, name) for name in dir(hora) if not name.startswith("_")}  # dir(): loads them all
    return {name: obj for name, obj in named.items()
            if not isinstance(obj, types.ModuleType) and type(obj).__module__ != "__future__"}


def _module_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None) if inspect.isclass(obj) or callable(obj) else None
    if module is None:  # a constant: where its type lives
        module = type(obj).__module__
    return module if module in SECTIONS else "hora.diagnostics.timeline" if module.startswith("hora.diagnostics") \
        else module


def _signature(obj: Any) -> str:
    try:
        text = _ADDRESS.sub("", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"
    text = text.replace(repr(hora.global_process_set), "global_process_set")  # its repr changes at init()
    return _QUOTED.sub(lambda m: m.group(1) + m.group(2), text)  # annotations are strings here: unquote


def _doc(obj: Any) -> str:
    return inspect.getdoc(obj) or ""


def _entry(name: str, obj: Any, aliases: list[str]) -> list[str]:
    also = f" (also `{'`, `'.join(aliases)}`)" if aliases else ""
    if inspect.isclass(obj):
        lines = [f"### class `{name}`{also}", ""]
        if not issubclass(obj, BaseException) and not issubclass(obj, enum.Enum) and "__init__" in vars(obj):
            lines += ["```python", f"{name}{_signature(obj)}", "```", ""]
        lines += [_doc(obj), ""]
        for member, value in sorted(vars(obj).items()):
            if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
                continue
            target = value.fget if isinstance(value, property) else value
            sig = "" if isinstance(value, property) else _signature(value)
            lines += [f"- `{name}.{member}{sig}`: {_doc(target).splitlines()[0] if _doc(target) else ''}".rstrip()]
        if lines[-1].startswith("- "):
            lines.append("")
        return lines
    if callable(obj):
        return [f"### `{name}{_signature(obj)}`{also}", "", _doc(obj), ""]
    if obj is hora.global_process_set:
        return [f"### `{name}`{also}", "", "The process set of every rank (set up by `init()`); the default of "
                "every collective's `process_set`.", ""]
    return [f"### `{name}` = `{obj!r}`{also}", ""]


def render() -> str:
    names = public_names()
    first_name: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name in sorted(names):
        key = id(names[name])
        if key in first_name and (inspect.isclass(names[name]) or callable(names[name])):
            aliases[first_name[key]].append(name)
        else:
            first_name.setdefault(key, name)
            aliases[name] = []
    groups: dict[str, list[str]] = {}
    for name in aliases:
        groups.setdefault(_module_of(names[name]), []).append(name)
    out = [HEADER, "", *(f"- [{SECTIONS[m]}](#{_anchor(SECTIONS[m])})" for m in SECTIONS if m in groups), ""]
    for module in [*SECTIONS, *sorted(set(groups) - set(SECTIONS))]:
        if module not in groups:
            continue
        out += [f"## {SECTIONS.get(module, module)}", ""]
        for name in groups[module]:
            out += _entry(name, names[name], aliases[name])
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Regenerate docs/api.md from hora's docstrings.")
    p.add_argument("--check", action="store_true", help="exit 1 when docs/api.md differs from the source")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/api.md is stale: run python scripts/gen_api_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
