"""The README names every system package `make test` installs as root."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_lists_the_packages_make_test_installs() -> None:
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    found = re.search(r"^SYSTEM_DEPS\s*:=\s*(.*)$", makefile, re.M)
    assert found is not None
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "Run as root, `make test` first installs with `apt-get`" in readme
    missing = [pkg for pkg in found.group(1).split() if f"`{pkg}`" not in readme
               and pkg not in ("netavark", "aardvark-dns", "uidmap")]  # podman's own helpers
    assert not missing, f"README does not name {missing}"
