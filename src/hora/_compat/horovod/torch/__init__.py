"""``import horovod.torch as hvd`` under ``hora run``: every public name of :mod:`hora`."""

from __future__ import annotations

import hora as _hora

globals().update({_name: getattr(_hora, _name) for _name in dir(_hora) if not _name.startswith("_")})
__version__ = "0.28.1"  # the Horovod API hora implements (see horovod/__init__.py)
