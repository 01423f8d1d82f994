"""Podman for the deployment tests: the CPU image built once per session, containers on a user network.

Settings this machine needs live here, not in the image: ``--runtime runc`` (crun fails on this cgroup
layout) and explicit ``--ulimit`` values (podman as root raises nofile/nproc above the hard limit, which fails
without CAP_SYS_RESOURCE). No image registry is reachable, so the base image is a minimal Debian made with
``mmdebstrap`` from Debian's mirror; the build mounts this machine's pip configuration, CA certificates and
local wheel directories read-only, so torch installs from the local CPU wheel. docker/Containerfile itself
stays generic.

Caching: podman's own storage is the cache. The base image is made only when missing (a few minutes, mostly
downloads); ``podman build`` reuses its layers, so a session whose hora sources did not change rebuilds
nothing and one whose sources changed re-runs only the last layers (hora's own install).

Names carry the pytest process's pid (``hora14-<pid>-...``) so concurrent sessions never collide, and
:func:`clean_stale` removes what a dead session left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ("podman", "--runtime", "runc")
LIMITS = ("--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096")
BASE_IMAGE = "localhost/hora-test-base:bookworm"
IMAGE = "localhost/hora-test:cpu"
MIRROR = "http://deb.debian.org/debian"
# Installed in the base already, so the Containerfile's apt-get step finds them (and downloads nothing).
BASE_PACKAGES = "ca-certificates,python3,python3-venv,openssh-server,openssh-client,tini,procps,iproute2"
PREFIX = f"hora14-{os.getpid()}"
TORCH_SPEC = "torch==2.13.0"  # requirements-dev.txt's pin: the CPU build on this machine's disk
_NAME_RE = re.compile(r"^hora14-(\d+)-")


def missing_requirements() -> str | None:
    """Why podman tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "container tests need root (podman with a user network)"
    missing = [t for t in ("podman", "runc", "mmdebstrap", "iptables", "catatonit") if shutil.which(t) is None]
    if missing:
        return f"container tests need {', '.join(missing)}: run `make system-deps` as root"
    return None


def podman(*args: str, timeout: float = 120, check: bool = True,
           input: str | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, input=input, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def _exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


def ensure_base() -> str:
    """The minimal Debian base image (made with mmdebstrap when podman does not have it yet)."""
    if _exists(BASE_IMAGE):
        return BASE_IMAGE
    tar = Path(os.environ.get("TMPDIR", "/var/tmp")) / f"{PREFIX}-base.tar"
    try:
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm",
                        str(tar), MIRROR], check=True, capture_output=True, text=True, timeout=1500)
        podman("import", "--quiet", str(tar), BASE_IMAGE, timeout=600)
    finally:
        tar.unlink(missing_ok=True)
    return BASE_IMAGE


def _pip_mounts() -> list[str]:
    """This machine's pip configuration and local package directories, read-only, at the same paths."""
    mounts: list[str] = []
    for conf in (Path.home() / ".config/pip/pip.conf", Path("/etc/pip.conf")):
        if conf.is_file():
            mounts += ["-v", f"{conf}:/etc/pip.conf:ro"]
            break
    for path in ("/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more"):
        if Path(path).exists():
            mounts += ["-v", f"{path}:{path}:ro"]
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if ca.is_file():
        mounts += ["-v", f"{ca}:{ca}:ro"]
    return mounts


def ensure_image() -> str:
    """The CPU image of docker/Containerfile built from this checkout (cached layers reused)."""
    base = ensure_base()
    before = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    podman("build", "--quiet", *LIMITS, "-f", "docker/Containerfile", "-t", IMAGE,
           "--build-arg", f"BASE={base}", "--build-arg", "TORCH_INDEX_URL=pip-config",
           "--build-arg", f"TORCH_SPEC={TORCH_SPEC}", *_pip_mounts(), str(ROOT), timeout=2400)
    after = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    if before and before != after:  # the previous build, now untagged: drop it (its shared layers stay)
        podman("rmi", before, check=False)
    return IMAGE


def clean_stale() -> None:
    """Remove containers and networks of earlier sessions whose pytest process is dead."""
    out = podman("ps", "-a", "--format", "{{.Names}}", check=False)
    for name in out.stdout.split():
        m = _NAME_RE.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            podman("rm", "-f", "-v", "-t", "0", name, check=False)
    out = podman("pod", "ls", "--format", "{{.Name}}", check=False)
    for name in out.stdout.split():
        m = _NAME_RE.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            podman("pod", "rm", "-f", "-t", "0", name, check=False)
    out = podman("network", "ls", "--format", "{{.Name}}", check=False)
    for name in out.stdout.split():
        m = _NAME_RE.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            podman("network", "rm", "-f", name, check=False)


@dataclass
class Container:
    name: str

    def exec(self, argv: Sequence[str], timeout: float = 300, check: bool = False,
             workdir: str | None = None) -> subprocess.CompletedProcess[str]:
        extra = ["--workdir", workdir] if workdir else []
        out = podman("exec", *extra, self.name, *argv, timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} in {self.name} failed ({out.returncode}):\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def logs(self) -> str:
        out = podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def ip(self) -> str:
        info = json.loads(podman("inspect", self.name).stdout)[0]
        nets = info["NetworkSettings"]["Networks"]
        return str(next(iter(nets.values()))["IPAddress"])

    def remove(self) -> None:
        """Remove the container and its anonymous volumes (the image declares /data and /checkpoints)."""
        podman("rm", "-f", "-v", "-t", "0", self.name, check=False)

    def wait_for_log(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            logs = self.logs()
            if text in logs:
                return logs
            state = podman("inspect", "--format", "{{.State.Status}}", self.name, check=False).stdout.strip()
            if state not in ("running", "created", "configured") or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} ({state}) never logged {text!r}:\n{logs[-3000:]}")
            time.sleep(0.5)


def run_container(name: str, image: str, args: Sequence[str], *, network: str | None = None,
                  volumes: Sequence[str] = (), env: dict[str, str] | None = None,
                  hostname: str | None = None) -> Container:
    """``podman run -d`` with this machine's settings; the container's name gets the session prefix."""
    full = f"{PREFIX}-{name}"
    opts = ["--name", full, "--hostname", hostname or name, "--shm-size", "256m", *LIMITS]
    if network:  # reachable on the network by its short name too
        opts += ["--network", network, "--network-alias", hostname or name]
    for v in volumes:
        opts += ["-v", v]
    for k, v in (env or {}).items():
        opts += ["-e", f"{k}={v}"]
    podman("run", "-d", *opts, image, *args)
    return Container(full)
