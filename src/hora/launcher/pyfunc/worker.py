"""The worker side of ``hora.run(fn)``: fetch the function from the store, call it, store the outcome.

Started by the launcher as ``python -m hora.launcher.pyfunc.worker`` on every rank. The outcome goes to the
driver's store under ``hora.run/result/<rank>``: ``("ok", value)`` or ``("error", exception or None,
type name, message, traceback text)`` (elastic jobs: see :func:`_keys`). A rank that raised exits with code 1
after printing its traceback. The function and the outcome travel through the job's
:class:`~hora.protocol.signedstore.SignedStore`: the function is unpickled only once its MAC is checked (the launcher
checks the outcome's before unpickling it), so the worker refuses to run without the job's secret.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import traceback

from torch.distributed import TCPStore

from hora.common import env as hora_env
from hora.common.env import WorkerEnv
from hora.errors import ConfigError, StoreAuthError
from hora.launcher.pyfunc import shipping
from hora.protocol import elastic as ep
from hora.protocol.messages import PYRUN_ELASTIC_ERROR_KEY as ELASTIC_ERROR_KEY
from hora.protocol.messages import PYRUN_ELASTIC_RESULT_KEY as ELASTIC_RESULT_KEY
from hora.protocol.messages import PYRUN_ERRORS_KEY as ERRORS_KEY
from hora.protocol.messages import PYRUN_FN_KEY as FN_KEY
from hora.protocol.messages import PYRUN_RESULT_KEY as RESULT_KEY
from hora.protocol.signedstore import SignedStore
from hora.runtime import lifecycle as runtime


def _store(env: WorkerEnv) -> SignedStore:
    secret = hora_env.job_secret()
    if secret is None:
        raise ConfigError("hora.run's worker has no job secret (HORA_SECRET): it unpickles the function it is sent "
                          "only once that is authenticated; start it with hora.run, which gives it one")
    raw = TCPStore(env.store_addr, env.store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    return SignedStore(raw, secret, env.job_id, f"{env.store_addr}:{env.store_port}")


def _error_record(exc: BaseException) -> tuple[bytes, str]:
    """What the caller of ``hora.run`` gets for ``exc`` (pickled), and its traceback's text."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # from the user's function on
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    exc_blob: bytes | None = None
    try:
        exc_blob = pickle.dumps(exc)
        pickle.loads(exc_blob)
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send the text only
        exc_blob = None  # an exception that does not survive pickling: its text still travels
    return pickle.dumps(("error", exc_blob, type(exc).__qualname__, str(exc), text)), text


def _keys(env: WorkerEnv, store: SignedStore) -> tuple[str, str]:
    """Where this process's value and its error go. Elastic: the value under the last world it was in and its
    rank there (the caller reads the last world's), the error under its worker id."""
    if not env.elastic:
        return RESULT_KEY.format(rank=env.rank), RESULT_KEY.format(rank=env.rank)
    error = ELASTIC_ERROR_KEY.format(worker_id=env.worker_id)
    gen = runtime.world_generation()
    key = ep.elastic_key(env.job_id, ep.WORLD, gen=gen)
    member = ep.World.from_json(store.get(key)).workers.get(env.worker_id) if gen and store.check([key]) else None
    if member is None:
        return error, error
    return ELASTIC_RESULT_KEY.format(gen=gen, rank=member.rank), error


def main() -> int:
    """Run this rank's share of ``hora.run``; return the process exit code."""
    env = WorkerEnv.from_environ()
    store = _store(env)
    try:
        fn, args, kwargs = shipping.load(store, FN_KEY)
    except StoreAuthError as exc:  # a stranger's function: never unpickled; the launcher is told why
        return _failed(store, _keys(env, store)[1], exc.with_traceback(None))
    try:
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        if env.elastic and exc.code in (0, None):
            return 0  # an elastic worker whose host was removed: it leaves, with nothing to return
        return _failed(store, _keys(env, store)[1], exc)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        return _failed(store, _keys(env, store)[1], exc)
    ok_key, error_key = _keys(env, store)
    try:
        record = shipping.dumps(("ok", value))
    except Exception as exc:  # noqa: BLE001
        store.set(error_key, _error_record(
            TypeError(f"rank {env.rank}: the return value of {getattr(fn, '__name__', fn)} cannot be "
                      f"pickled: {exc}"))[0])
        return 1
    store.set(ok_key, record)
    return 0


def _failed(store: SignedStore, key: str, exc: BaseException) -> int:
    record, text = _error_record(exc)
    store.set(key, record)
    store.add(ERRORS_KEY, 1)
    sys.stderr.write(text)
    # As after an uncaught exception (the interpreter sets these): hora's exit hook leaves at once, so the peers
    # learn now that this rank is gone, not after waiting for them to reach shutdown.
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    return 1


if __name__ == "__main__":
    sys.exit(main())
