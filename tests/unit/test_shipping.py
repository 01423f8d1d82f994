"""Shipping functions and their arguments to ``hora.run``'s workers (cloudpickle underneath)."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import threading

import pytest

from hora.errors import ConfigError
from hora.launcher.pyfunc.shipping import dumps, loads

OFFSET = 100


def _round_trip_in_fresh_process(blob: bytes) -> str:
    # A bare interpreter: hora's package is registered without running hora/__init__ (no torch import),
    # the way the launcher's agent bootstrap does it.
    code = ("import sys, types, importlib.util as u; s = u.find_spec('hora'); m = types.ModuleType('hora'); "
            "m.__path__ = list(s.submodule_search_locations); sys.modules['hora'] = m; "
            "from hora.launcher.pyfunc.shipping import loads; "
            "fn, args = loads(sys.stdin.buffer.read()); print(fn(*args))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().strip()


def test_lambda_closure_and_module_global_survive() -> None:
    scale = 3

    def outer() -> object:
        bias = 5
        return lambda x: x * scale + bias + OFFSET + math.floor(0.5)

    assert loads(dumps(outer()))(2) == 2 * 3 + 5 + 100


def test_recursive_local_function() -> None:
    def fact(n: int) -> int:
        return 1 if n <= 1 else n * fact(n - 1)

    assert loads(dumps(fact))(5) == 120


def test_defaults_and_keyword_only_defaults() -> None:
    def f(a: int, b: int = 2, *, c: int = 3) -> int:
        return a + b * c

    g = loads(dumps(f))
    assert (g(1), g(1, c=10)) == (7, 21)


def test_importable_functions_travel_by_reference() -> None:
    assert b"shipping" not in dumps(math.sqrt)
    assert loads(dumps(pickle.dumps)) is pickle.dumps


def test_a_lambda_runs_in_another_process() -> None:
    factor = 7
    assert _round_trip_in_fresh_process(dumps((lambda x: x * factor, (6,)))) == "42"


def test_class_defined_in_main_travels_by_value() -> None:
    cls = type("Model", (), {"__module__": "__main__", "__call__": lambda self, x: x + 1})
    assert _round_trip_in_fresh_process(dumps((cls(), (41,)))) == "42"


def test_an_unpicklable_argument_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot send the function"):
        dumps((print, (threading.Lock(),)))


def test_a_rank_that_forgot_init_raises_the_message_once_in_the_caller() -> None:
    """Issue 33.6: hora.run's caller saw "hora has not been initialized: hora has not been initialized: ..."."""
    import hora as hvd
    from hora.launcher.pyfunc import run, worker

    try:
        hvd.rank()
    except hvd.NotInitializedError as e:
        record, _ = worker._error_record(e)
    with pytest.raises(hvd.NotInitializedError) as raised:
        run._reraise("rank 0 on localhost", pickle.loads(record))
    assert str(raised.value) == ("hora has not been initialized: hvd.rank() needs hora.init() first. Call hvd.init() "
                                 "at the top of your training script.")
