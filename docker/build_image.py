#!/usr/bin/env python3
"""Build hora's container image where Docker Hub is reachable and where it is not, then check it runs.

    python3 docker/build_image.py                  # CPU image localhost/hora:cpu (what `make image` runs)
    python3 docker/build_image.py --flavor cuda    # CUDA image localhost/hora:cuda (`make image-cuda`)

Steps, each announced on stderr:

1. **The base.** The public ``debian:bookworm-slim`` when the engine has it or can pull it. Where the
   registry is unreachable (an air-gapped cluster), a minimal Debian made with ``mmdebstrap`` from the Debian
   mirror apt already uses, imported once as ``localhost/hora-base:bookworm`` and reused after.
2. **torch.** The CPU image takes PyTorch's CPU wheel index where it answers; where it does not, pip inside
   the build uses this machine's pip configuration (its ``pip.conf``, local wheel and index directories and CA
   certificates are mounted read-only at the same paths; podman only, ``docker build`` cannot mount) and the
   pin ``torch==VERSION+cpu``, so pip can never fall back to the multi-GB CUDA build.
3. **The build** of docker/Containerfile, with ``--ulimit`` values no higher than this shell's hard limits:
   podman as root otherwise raises nofile/nproc above them, which fails without CAP_SYS_RESOURCE (inside a
   container, say) and leaves containers stuck in "Created".
4. **The check**: ``hora check`` in a fresh container of the new image (on the GPUs for the CUDA flavour when
   ``nvidia-smi`` exists). The exit code is that check's.

The deployment tests (tests/deploy/podman.py) build their image through :func:`build`, so ``make image`` and
the tests share one implementation and podman's layer cache: a build whose arguments and sources did not
change reuses every layer.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_BASE = "docker.io/library/debian:bookworm-slim"
DEBIAN_BASE = "localhost/hora-base:bookworm"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# Installed in the Debian-packages base already, so the Containerfile's apt-get step downloads nothing.
BASE_PACKAGES = "ca-certificates,python3,python3-venv,openssh-server,openssh-client,tini,procps,iproute2"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_VERSION = "2.13.0"  # the Makefile's TORCH_VERSION (it passes its own)
PIP_DIRS = ("/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more")


class ImageError(Exception):
    """A step that failed, with what to do about it."""


def say(message: str) -> None:
    print(f"build_image: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Engine:
    """``podman`` or ``docker`` with the settings every call of this machine needs."""

    program: str = "podman"
    runtime: str | None = None  # podman --runtime (e.g. runc where crun fails on the cgroup layout)

    @property
    def argv(self) -> tuple[str, ...]:
        return (self.program, "--runtime", self.runtime) if self.runtime else (self.program,)

    def run(self, *args: str, timeout: float = 120, check: bool = True, quiet: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run the engine; ``quiet=False`` lets its output through to the user's terminal."""
        out = subprocess.run([*self.argv, *args], capture_output=quiet, text=True, timeout=timeout,
                             input=input, check=False)
        if check and out.returncode != 0:
            detail = f":\n{(out.stderr or '')[-3000:]}" if quiet else " (its output is above)"
            raise ImageError(f"{self.program} {' '.join(args[:3])} ... failed with exit code {out.returncode}"
                             f"{detail}")
        return out

    def has_image(self, image: str) -> bool:
        return self.run("image", "inspect", "--format", "{{.Id}}", image, check=False).returncode == 0

    def image_id(self, image: str) -> str:
        return self.run("image", "inspect", "--format", "{{.Id}}", image, check=False).stdout.strip()


def ulimit_args() -> tuple[str, ...]:
    """``--ulimit`` flags no higher than this process may set: nofile at its hard limit, nproc at its hard limit
    or the kernel's pid_max if lower (podman as root lowers its own nproc limit to pid_max at start, and a
    container cannot get more than podman has)."""
    nproc = [v for v in (_hard(resource.RLIMIT_NPROC), _pid_max()) if v is not None]
    limits = {"nofile": _hard(resource.RLIMIT_NOFILE), "nproc": min(nproc) if nproc else None}
    return tuple(arg for name, value in limits.items() if value is not None
                 for arg in ("--ulimit", f"{name}={value}:{value}"))


def _hard(which: int) -> int | None:
    """The hard limit, None when unlimited."""
    hard = resource.getrlimit(which)[1]
    return None if hard == resource.RLIM_INFINITY else hard


def _pid_max() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class BaseChoice:
    image: str
    why: str


def choose_base(engine: Engine, public: str = PUBLIC_BASE, timeout: float = 600) -> BaseChoice:
    """The public base when the engine has it or can pull it, else the Debian-packages base (made if missing)."""
    if engine.has_image(public):
        return BaseChoice(public, f"{public}, the public base (pulled earlier)")
    try:
        pulled = engine.run("pull", "--quiet", public, check=False, timeout=timeout)
        error = (pulled.stderr.strip().splitlines() or ["no message"])[-1].removeprefix("Error: ")
    except subprocess.TimeoutExpired:
        pulled, error = None, f"no answer in {timeout:.0f} s"
    if pulled is not None and pulled.returncode == 0:
        return BaseChoice(public, f"{public}, the public base (pulled now)")
    reason = f"{public} cannot be pulled: {error}"
    if engine.has_image(DEBIAN_BASE):
        return BaseChoice(DEBIAN_BASE, f"{DEBIAN_BASE}, made earlier from Debian packages with mmdebstrap "
                                       f"(`{engine.program} rmi {DEBIAN_BASE}` makes it anew), because {reason}")
    make_debian_base(engine, reason)
    return BaseChoice(DEBIAN_BASE, f"{DEBIAN_BASE}, made now from Debian packages with mmdebstrap, because {reason}")


def make_debian_base(engine: Engine, reason: str) -> None:
    """A minimal Debian ``SUITE`` from the Debian mirror, imported as ``DEBIAN_BASE``."""
    if shutil.which("mmdebstrap") is None:
        raise ImageError(f"{reason}, and mmdebstrap, which makes a base from Debian packages instead, is not "
                         "installed: `apt-get install mmdebstrap` (or `make system-deps` as root), or pull a "
                         "Debian image from a registry you can reach and pass it as PUBLIC_BASE=...")
    say(f"{reason}: making {DEBIAN_BASE} from Debian packages with mmdebstrap ({MIRROR}; a few minutes, once)")
    tar = Path(os.environ.get("TMPDIR", "/var/tmp")) / f"hora-base-{os.getpid()}.tar"
    try:
        made = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE,
                               str(tar), MIRROR], capture_output=True, text=True, timeout=1800, check=False)
        if made.returncode != 0:
            raise ImageError(f"mmdebstrap could not make a Debian base from {MIRROR} (exit code "
                             f"{made.returncode}); apt on this machine must reach a Debian mirror:\n"
                             f"{made.stderr[-3000:]}")
        engine.run("import", "--quiet" if engine.program == "podman" else "--message=hora-base", str(tar),
                   DEBIAN_BASE, timeout=900)
    finally:
        tar.unlink(missing_ok=True)


def index_answers(url: str, timeout: float = 15) -> bool:
    """Whether ``url`` answers over HTTP(S) from here (proxies as configured in the environment)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, if only with an error page: reachable
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pip_config_mounts() -> list[str]:
    """This machine's pip configuration, local package directories and CA bundle, read-only at the same paths."""
    mounts: list[str] = []
    for conf in (Path.home() / ".config/pip/pip.conf", Path("/etc/pip.conf")):
        if conf.is_file():
            mounts += ["-v", f"{conf}:/etc/pip.conf:ro"]
            break
    for path in PIP_DIRS:
        if Path(path).exists():
            mounts += ["-v", f"{path}:{path}:ro"]
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if ca.is_file():
        mounts += ["-v", f"{ca}:{ca}:ro"]
    return mounts


@dataclass(frozen=True)
class TorchSource:
    build_args: tuple[str, ...]
    mounts: tuple[str, ...] = field(default=())
    why: str = ""


def choose_torch(engine: Engine, flavor: str, version: str, index: str | None) -> TorchSource:
    """Where pip in the build takes torch from: ``index`` when given, else PyPI's / PyTorch's index where it
    answers, else this machine's pip configuration (podman only)."""
    pinned = f"torch=={version}+cpu" if flavor == "cpu" else f"torch=={version}"
    if index and index != "pip-config":
        return TorchSource(("--build-arg", f"TORCH_INDEX_URL={index}", "--build-arg", f"TORCH_SPEC={pinned}"),
                           why=f"torch {version} from {index}")
    public = CPU_INDEX if flavor == "cpu" else "https://pypi.org/simple/torch/"
    if index is None and index_answers(public):
        return TorchSource(("--build-arg", f"TORCH_SPEC={pinned}"), why=f"{pinned} from {public}")
    if engine.program != "podman":
        raise ImageError(f"{public} does not answer from here, and only podman can lend the build this machine's "
                         "pip configuration (docker build cannot mount it): use CONTAINER=podman, or "
                         "TORCH_INDEX_URL=<a mirror the build can reach>")
    why = "as asked" if index == "pip-config" else f"{public} does not answer from here"
    return TorchSource(("--build-arg", "TORCH_INDEX_URL=pip-config", "--build-arg", f"TORCH_SPEC={pinned}"),
                       tuple(pip_config_mounts()), f"{pinned} through this machine's pip configuration ({why})")


@dataclass(frozen=True)
class Request:
    tag: str
    flavor: str = "cpu"
    torch_version: str = TORCH_VERSION
    torch_index: str | None = None  # None: choose; "pip-config": this machine's pip configuration; else a URL
    public_base: str = PUBLIC_BASE
    quiet: bool = False


def build(engine: Engine, request: Request) -> str:
    """Build ``request.tag`` from docker/Containerfile, saying which base and torch it took; returns the tag."""
    if request.flavor not in ("cpu", "cuda"):
        raise ImageError(f"flavor {request.flavor!r}: choose cpu or cuda")
    base = choose_base(engine, request.public_base)
    say(f"base: {base.why}")
    torch = choose_torch(engine, request.flavor, request.torch_version, request.torch_index)
    say(f"torch: {torch.why}")
    before = engine.image_id(request.tag)
    say(f"building {request.tag} from docker/Containerfile (FLAVOR={request.flavor}; unchanged layers are reused)")
    engine.run("build", *(("--quiet",) if request.quiet else ()), *ulimit_args(), "-f", "docker/Containerfile",
               "-t", request.tag, "--build-arg", f"FLAVOR={request.flavor}", "--build-arg", f"BASE={base.image}",
               *torch.build_args, *torch.mounts, str(ROOT), timeout=3600, quiet=request.quiet)
    after = engine.image_id(request.tag)
    if before and before != after:  # the previous build, now untagged: drop it (its shared layers stay)
        engine.run("rmi", before, check=False)
    return request.tag


def check(engine: Engine, tag: str, flavor: str) -> int:
    """``hora check`` in a fresh container of ``tag``; its exit code."""
    gpus = ("--gpus", "all") if flavor == "cuda" and shutil.which("nvidia-smi") else ()
    argv = ("run", "--rm", "--shm-size=2g", *ulimit_args(), *gpus, tag, "hora", "check")
    say(f"checking: {' '.join((*engine.argv, *argv))}")
    out = engine.run(*argv, timeout=600, check=False, quiet=False)
    if out.returncode == 0:
        say(f"{tag} is ready: hora check passed in it")
    else:
        say(f"hora check failed in {tag} (exit code {out.returncode}; its output is above)")
    return out.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--flavor", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tag", help="image name (default localhost/hora:FLAVOR, compose.yaml's default)")
    parser.add_argument("--engine", default=os.environ.get("CONTAINER") or "podman", help="podman or docker")
    parser.add_argument("--runtime", default=None, help="podman --runtime (e.g. runc)")
    parser.add_argument("--torch-version", default=TORCH_VERSION)
    parser.add_argument("--torch-index", default=None,
                        help="a pip index URL for torch, or pip-config for this machine's pip configuration "
                             "(default: the public index where it answers, else pip-config)")
    parser.add_argument("--public-base", default=PUBLIC_BASE, help=f"the public base to try (default {PUBLIC_BASE})")
    parser.add_argument("--no-check", action="store_true", help="build only, do not run hora check")
    args = parser.parse_args(argv)
    if shutil.which(args.engine) is None:
        say(f"{args.engine} is not installed: install podman (or docker and pass CONTAINER=docker)")
        return 2
    engine = Engine(args.engine, args.runtime or None)
    request = Request(args.tag or f"localhost/hora:{args.flavor}", args.flavor, args.torch_version,
                      args.torch_index or None, args.public_base)
    try:
        tag = build(engine, request)
    except (ImageError, subprocess.TimeoutExpired) as exc:
        say(f"error: {exc}")
        return 1
    return 0 if args.no_check else check(engine, tag, args.flavor)


if __name__ == "__main__":
    sys.exit(main())
