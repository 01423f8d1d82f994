"""Shipping a Python function and its arguments to the workers of ``hora.run(fn)``: closures and lambdas included.

:mod:`cloudpickle` (a dependency of hora) does the work: a function that cannot be pickled by reference (a
lambda, a closure, anything defined in ``__main__`` or a notebook) travels by value, and so do classes
defined in ``__main__``. Code travels as bytecode, hence the same Python version on every host (preflight
checks it). The receiving side needs only :mod:`pickle` (and cloudpickle installed, as hora's dependency).

Example:
    >>> k = 3
    >>> fn = loads(dumps(lambda x: x * k))
    >>> fn(2)
    6
"""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle

from hora.errors import ConfigError
from hora.protocol.signedstore import SignedStore


def dumps(obj: Any) -> bytes:
    """Serialise ``obj`` (typically ``(fn, args, kwargs)``) for another process of the same Python.

    Raises:
        ConfigError: something in ``obj`` cannot be pickled (an open file, a lock, a socket...).
    """
    try:
        return bytes(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(f"hora.run: cannot send the function, its arguments or its result between processes: "
                          f"{exc}; pass only picklable values (create files, locks and sockets inside the "
                          "function)") from None


def loads(data: bytes) -> Any:
    """Inverse of :func:`dumps`, for bytes this process made: what comes from another goes through :func:`load`."""
    return pickle.loads(data)


def load(store: SignedStore, key: str) -> Any:
    """The object another process put under ``key`` with :func:`dumps`, unpickled only once the store has
    authenticated it (:class:`~hora.protocol.signedstore.SignedStore` raises ``StoreAuthError`` first)."""
    return pickle.loads(store.get(key))
