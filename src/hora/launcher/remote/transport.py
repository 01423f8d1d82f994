"""How the driver starts a process on a host: :class:`LocalTransport` or :class:`SshTransport`.

Both build an argv and start it with pipes on stdin/stdout/stderr, in a new session (so a Ctrl-C in the
terminal reaches only the driver) and with a parent-death signal. Tests swap transports, never patch.

Example:
    >>> SshTransport(port=2222, identity_file="/k").command("10.0.0.2", ["python", "-V"])[:3]
    ['ssh', '-o', 'BatchMode=yes']
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hora.launcher import procs

SSH_FAILED = 255  # ssh's own exit code: it could not connect or authenticate, or the connection dropped

# Runs the agent without executing hora/__init__ (which imports torch and the worker core): the agent
# needs only the light modules of hora.launcher. Not a secret; the job spec itself goes on stdin.
BOOTSTRAP = (
    "import importlib.util as u,sys,types\n"
    "if 'hora' not in sys.modules:\n"
    " s=u.find_spec('hora')\n"
    " if s is None: sys.exit('hora agent: hora is not installed for '+sys.executable)\n"
    " m=types.ModuleType('hora');m.__path__=list(s.submodule_search_locations);m.__spec__=s\n"
    " sys.modules['hora']=m\n"
    "from hora.launcher.remote.agent import main;sys.exit(main())"
)


def agent_argv(python: str = sys.executable) -> list[str]:
    """The command that starts an agent with ``python``."""
    return [python, "-u", "-c", BOOTSTRAP]


class Transport(Protocol):
    """Starts a command on a host."""

    def command(self, host: str, argv: list[str], cwd: str | None = None) -> list[str]:
        """The local argv that runs ``argv`` on ``host``."""
        ...

    def start(self, host: str, argv: list[str], cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` with stdin, stdout and stderr piped."""
        ...


def _popen(argv: list[str], cwd: str | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, preexec_fn=procs.child_setup(os.getpid()),  # noqa: PLW1509 - only prctl
    )


@dataclass(frozen=True)
class LocalTransport:
    """Runs commands on this machine, as child processes."""

    def command(self, host: str, argv: list[str], cwd: str | None = None) -> list[str]:
        return list(argv)

    def start(self, host: str, argv: list[str], cwd: str | None = None) -> subprocess.Popen[bytes]:
        return _popen(self.command(host, argv), cwd if cwd and os.path.isdir(cwd) else None)


@dataclass(frozen=True)
class SshTransport:
    """Runs commands on a host through ``ssh`` in BatchMode (never a password prompt).

    Args:
        port: ``-p`` port; None uses ssh's default (or the config file's).
        identity_file: ``-i`` private key.
        options: extra ``-o`` options, e.g. ``("StrictHostKeyChecking=no",)``.
        config_file: ``-F`` ssh config file.
        connect_timeout: seconds ssh waits for the connection.
        alive_interval: seconds between keep-alives; a silent link is dropped after 3 missed ones.
    """

    port: int | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = field(default_factory=tuple)
    config_file: str | None = None
    connect_timeout: int = 10
    alive_interval: int = 5

    def ssh_prefix(self, host: str) -> list[str]:
        """``ssh [options] host``, without the remote command."""
        # ssh keeps the first value it sees for an option: the user's -o come before hora's defaults
        # (BatchMode stays first: never a password prompt)
        argv = ["ssh", "-o", "BatchMode=yes"]
        if self.config_file:
            argv += ["-F", self.config_file]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file]
        for option in self.options:
            argv += ["-o", option]
        argv += ["-o", f"ConnectTimeout={self.connect_timeout}", "-o", f"ServerAliveInterval={self.alive_interval}",
                 "-o", "ServerAliveCountMax=3"]
        return argv + [host.strip("[]")]

    def command(self, host: str, argv: list[str], cwd: str | None = None) -> list[str]:
        remote = f"exec {shlex.join(argv)}"
        if cwd:
            remote = f"cd {shlex.quote(cwd)} 2>/dev/null; {remote}"
        return self.ssh_prefix(host) + [remote]

    def start(self, host: str, argv: list[str], cwd: str | None = None) -> subprocess.Popen[bytes]:
        return _popen(self.command(host, argv, cwd), None)


def transport_for(ssh: SshTransport) -> Callable[[str, bool], Transport]:
    """``(host, is_local) -> Transport``: local hosts run as child processes, the others over ``ssh``."""
    local = LocalTransport()
    return lambda host, is_local: local if is_local else ssh


def describe(argv: list[str]) -> str:
    """A shell-ready rendering of ``argv`` for error messages."""
    return shlex.join(argv)
