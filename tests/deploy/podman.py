"""Podman for the deployment tests: the CPU image built once per session, containers on a user network.

The image is built by docker/build_image.py, the implementation `make image` runs, so the tests and users
share one way of building and podman's layer cache (``make image IMAGE=localhost/hora-test:cpu`` after a test
session rebuilds nothing). No image registry is reachable on this machine, so it takes the Debian-packages base
(``mmdebstrap``, made once) and torch through this machine's pip configuration, and says so.

Settings this machine needs live here and there, not in the image: ``--runtime runc`` (crun fails on this
cgroup layout) and ``--ulimit`` values at the shell's hard limits (podman as root raises nofile/nproc above
them, which fails without CAP_SYS_RESOURCE). docker/Containerfile itself stays generic.

Names carry the pytest process's pid (``hora14-<pid>-...``) so concurrent sessions never collide, and
:func:`clean_stale` removes what a dead session left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _load_builder() -> ModuleType:
    """docker/build_image.py, a script rather than a package module."""
    spec = importlib.util.spec_from_file_location("hora_build_image", ROOT / "docker" / "build_image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


builder = _load_builder()
RUNTIME = "runc"
ENGINE = builder.Engine("podman", RUNTIME)
PODMAN = ENGINE.argv
LIMITS = builder.ulimit_args()
IMAGE = "localhost/hora-test:cpu"
PREFIX = f"hora14-{os.getpid()}"
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


def ensure_image() -> str:
    """The CPU image of docker/Containerfile built from this checkout (cached layers reused)."""
    return builder.build(ENGINE, builder.Request(IMAGE, quiet=True))


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
        def state() -> str:
            return podman("inspect", "--format", "{{.State.Status}}", self.name, check=False).stdout.strip()

        def logged() -> str:
            logs = self.logs()
            return logs if text in logs else ""

        logs = wait_until(logged, timeout=timeout, step=0.5,
                          unless=lambda: state() not in ("running", "created", "configured"))
        if not logs:
            raise AssertionError(f"{self.name} ({state()}) never logged {text!r}:\n{self.logs()[-3000:]}")
        return logs


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


@dataclass
class Pair:
    """Two containers running sshd on one user network, sharing a host directory as /data."""

    network: str
    nodes: list[Container]
    data: Path
    keys: Path


def make_keys(where: Path) -> Path:
    """An SSH key pair and authorized_keys as a mounted secret would give them (loose permissions on purpose)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(where / "id_ed25519")], check=True)
    (where / "authorized_keys").write_text((where / "id_ed25519.pub").read_text())
    for f in where.iterdir():
        f.chmod(0o666 if f.name == "authorized_keys" else 0o644)  # the entrypoint must fix these
    return where
