"""Shipping a Python function to other processes: closures and lambdas included.

With ``cloudpickle`` installed it is used. Without it, plain :mod:`pickle` does the work, extended so that
a function which cannot be pickled by reference (a lambda, a closure, anything defined in ``__main__`` or
a notebook) travels by value: its code object (:mod:`marshal`, hence the same Python version on every
host, which preflight checks), defaults, closure cells and the globals its code uses. Modules travel by
name. Classes defined in ``__main__`` need cloudpickle.

Example:
    >>> k = 3
    >>> fn = loads(dumps(lambda x: x * k))
    >>> fn(2)
    6
"""

from __future__ import annotations

import builtins
import importlib
import io
import marshal
import pickle
import types
from typing import Any

from hora.errors import ConfigError

_BY_VALUE_MODULES = ("__main__", "__mp_main__")


def _importable(func: types.FunctionType) -> bool:
    module = getattr(func, "__module__", None)
    if module is None or module in _BY_VALUE_MODULES or "<" in func.__qualname__:
        return False
    try:
        found: Any = importlib.import_module(module)
        for part in func.__qualname__.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is func


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _skeleton(code_bytes: bytes, name: str, qualname: str, module: str, ncells: int) -> types.FunctionType:
    code = marshal.loads(code_bytes)
    globals_ = {"__builtins__": builtins, "__name__": module}
    closure = tuple(types.CellType() for _ in range(ncells)) or None
    func = types.FunctionType(code, globals_, name, None, closure)
    func.__qualname__ = qualname
    return func


def _fill(func: types.FunctionType, state: tuple[Any, ...]) -> types.FunctionType:
    globals_, defaults, kwdefaults, cells, attrs = state
    func.__globals__.update(globals_)
    func.__defaults__ = defaults
    func.__kwdefaults__ = kwdefaults
    for cell, value in zip(func.__closure__ or (), cells):
        if value is not _EMPTY:
            cell.cell_contents = value
    func.__dict__.update(attrs)
    return func


class _Empty:
    def __reduce__(self) -> str:
        return "_EMPTY"


_EMPTY = _Empty()


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled (a function that refers to itself before definition ends)
        return _EMPTY


class _Pickler(pickle.Pickler):
    """pickle.Pickler that ships non-importable functions by value and modules by name."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, types.FunctionType) and not _importable(obj):
            return self._function(obj)
        if isinstance(obj, type) and obj.__module__ in _BY_VALUE_MODULES:
            raise ConfigError(f"hora.run: class {obj.__qualname__} is defined in __main__ (a script or notebook) "
                              "and cannot be shipped by value without cloudpickle; pip install cloudpickle, "
                              "or define the class in an importable module")
        return NotImplemented

    @staticmethod
    def _function(func: types.FunctionType) -> tuple[Any, ...]:
        code = func.__code__
        used = {n: func.__globals__[n] for n in _global_names(code) if n in func.__globals__}
        cells = tuple(_cell_value(c) for c in func.__closure__ or ())
        state = (used, func.__defaults__, func.__kwdefaults__, cells, dict(func.__dict__))
        args = (marshal.dumps(code), func.__name__, func.__qualname__, func.__module__, len(cells))
        return _skeleton, args, state, None, None, _fill


def dumps(obj: Any) -> bytes:
    """Serialise ``obj`` (typically ``(fn, args, kwargs)``) for another process of the same Python."""
    try:
        import cloudpickle

        return b"C" + cloudpickle.dumps(obj)
    except ImportError:
        pass
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(f"hora.run: cannot send the function or its arguments to the workers: {exc}") from None
    return b"P" + buf.getvalue()


def loads(data: bytes) -> Any:
    """Inverse of :func:`dumps`."""
    return pickle.loads(data[1:])


def dumps_plain(obj: Any) -> bytes:
    """Like :func:`dumps` but never cloudpickle (tests and results use it)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return b"P" + buf.getvalue()
