"""hora's stand-in for the ``horovod`` package (only on PYTHONPATH under ``hora run``, without real Horovod)."""

from __future__ import annotations

from hora import __version__ as __hora_version__  # noqa: F401
from hora.launcher.pyfunc.run import run  # noqa: F401  (``horovod.run``, as Horovod's package exports it)

# Old scripts gate features on Horovod's version (``>= 0.20``...): hora implements the API of Horovod's last
# release, so it answers with that version. hora's own version is __hora_version__.
__version__ = "0.28.1"
