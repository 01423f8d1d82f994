"""`make image` (docker/build_image.py): where the public base cannot be pulled it builds on a base made from
Debian packages, says so, and checks that the image runs `hora check`.

It shares the session's image (the ``image`` fixture builds the same tag through the same code), so podman's
layer cache makes this a re-tag plus one ``hora check`` run, not a second build.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.deploy import podman as pm

pytestmark = pytest.mark.containers

UNREACHABLE = "registry.invalid/library/debian:bookworm-slim"  # .invalid never resolves (RFC 2606)


def test_make_image_takes_the_debian_packages_base_when_the_public_one_cannot_be_pulled(image: str) -> None:
    out = subprocess.run(["make", "--no-print-directory", "image", f"IMAGE={image}", f"OCI_RUNTIME={pm.RUNTIME}",
                          f"PUBLIC_BASE={UNREACHABLE}"],
                         cwd=pm.ROOT, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "TORCH_INDEX_URL": ""})
    said = [line for line in out.stderr.splitlines() if line.startswith("build_image: ")]
    assert out.returncode == 0, "\n".join(said) + out.stderr[-3000:]
    assert any(line.startswith(f"build_image: base: {pm.builder.DEBIAN_BASE}, made ")
               and "from Debian packages with mmdebstrap" in line
               and f"because {UNREACHABLE} cannot be pulled: " in line for line in said), said
    assert any(line.startswith("build_image: torch: torch==") for line in said), said
    assert "OK: every host answered and versions agree" in out.stdout, out.stdout[-3000:]
    assert said[-1] == f"build_image: {image} is ready: hora check passed in it"
