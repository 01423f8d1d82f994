"""Horovod 0.28.1's own sources, for tests that check hora against them (never copied into this repository).

:func:`horovod_sdist` downloads the sdist from PyPI with pip (``pip download --no-deps --no-binary :all:
horovod==0.28.1``) once per machine and extracts it under ``~/.cache/hora`` (``HORA_HOROVOD_CACHE`` moves it).
The sdist holds the library (``horovod/``), not Horovod's tests or examples.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.28.1"


def cache_dir() -> Path:
    """Where Horovod's sources are kept between sessions."""
    return Path(os.environ.get("HORA_HOROVOD_CACHE") or Path.home() / ".cache" / "hora") / f"horovod-{VERSION}"


def horovod_sdist() -> Path:
    """The extracted sdist's root (``.../horovod-0.28.1``), downloaded on first use.

    Raises:
        RuntimeError: pip could not download it (no route to PyPI), with pip's last lines.
    """
    root = cache_dir() / f"horovod-{VERSION}"
    if (root / "horovod" / "runner" / "launch.py").is_file():
        return root
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"horovod=={VERSION}", "-d", tmp], capture_output=True, text=True, timeout=600)
        archive = Path(tmp) / f"horovod-{VERSION}.tar.gz"
        if done.returncode != 0 or not archive.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-3:])
            raise RuntimeError(f"pip could not download horovod=={VERSION}'s sdist: {tail}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        if not root.exists():
            shutil.move(str(Path(tmp) / f"horovod-{VERSION}"), str(root))
    return root
