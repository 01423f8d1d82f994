"""Preflight: before anything starts, every remote host is checked in parallel, within --start-timeout.

Checked: the host answers over ssh (BatchMode, no password prompt), it has the launcher's Python, the
same Python, torch and hora versions, and the same hora code (:mod:`hora.protocol.code_fingerprint`: two installs
that share a version string can differ). Each problem is one line naming the host and the fix (for a
connection failure, the exact ssh command to reproduce it); then the launcher exits with code 2. A connection
that sshd drops before its handshake (too many logins at once: its ``MaxStartups``) is tried again a few times
with backoff before it counts as a problem.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import platform
import random
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from hora.errors import SetupError
from hora.launcher import output
from hora.launcher.hosts import HostSpec
from hora.launcher.remote.transport import SSH_FAILED, LocalTransport, Transport, describe
from hora.protocol import code_fingerprint

if TYPE_CHECKING:
    from hora.launcher.config import RunConfig

log = logging.getLogger(__name__)

# the fingerprint's own source runs first (standard library only), so every host hashes its hora the same way
# without importing it
PROBE = inspect.getsource(code_fingerprint) + (
    "import json,os,platform\n"
    "from importlib import metadata as m\n"
    "def v(n):\n"
    "    try: return m.version(n)\n"
    "    except Exception: return None\n"
    "def i():\n"
    "    try: return open('/proc/sys/kernel/random/boot_id').read().strip()+'/'+os.readlink('/proc/self/ns/net')\n"
    "    except OSError: return None\n"
    "print(json.dumps({'python':platform.python_version(),'torch':v('torch'),'hora':v('hora'),"
    "'cpus':os.cpu_count(),'hostname':platform.node(),'machine':i(),"
    "'code':(lambda r: fingerprint_of(r) if r else None)(package_root('hora'))}))"
)
VERSION_KEYS = ("python", "torch", "hora")
# sshd closes a connection before its handshake when too many wait to log in (MaxStartups): try again, after
# SSH_RETRY_BACKOFF s, doubling (with jitter, so jobs that collided do not collide again)
_DROPPED = re.compile(r"(kex|ssh)_exchange_identification")
SSH_RETRIES = 4
SSH_RETRY_BACKOFF = 0.5


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def hora_version() -> str:
    """hora's installed version (without importing hora's core)."""
    return _version("hora") or "unknown"


def local_versions() -> dict[str, Any]:
    """What the probe reports, for this machine."""
    return {"python": platform.python_version(), "torch": _version("torch"), "hora": _version("hora"),
            "code": code_fingerprint.code_fingerprint()}


def machine_identity() -> str | None:
    """What tells machines apart: the kernel's boot id and the network namespace (so namespace "hosts" on one
    kernel stay distinct). Two host entries with the same identity are the same machine. The probe computes
    the same on every remote host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() + "/" + os.readlink("/proc/self/ns/net")
    except OSError:
        return None


def refuse_same_machine(hosts: Sequence[HostSpec], used: set[str], answers: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse a job whose host list names one machine twice (``localhost`` and ``127.0.0.1``, or a host name and
    its address): its ranks would be numbered as on two hosts, both with ``local_rank`` 0 (so both on GPU 0).

    Local entries are this machine; a remote one is identified by its probe's answer.

    Raises:
        SetupError: (exit code 2) after one line per machine listed more than once.
    """
    mine = machine_identity()
    groups: dict[str, list[HostSpec]] = {}
    for host in hosts:
        if host.name not in used:
            continue
        ident = "this machine" if host.is_local else answers.get(host.name, {}).get("machine")
        if ident == mine and mine is not None:
            ident = "this machine"
        if ident:
            groups.setdefault(ident, []).append(host)
    problems = []
    for ident, same in groups.items():
        if len(same) < 2:
            continue
        names = " and ".join(", ".join(h.name for h in same).rsplit(", ", 1))
        where = " (this machine)" if ident == "this machine" else ""
        total = sum(h.slots for h in same)
        problems.append(f"hosts {names} are the same machine{where}: listed twice, its ranks would be numbered "
                        "as on separate hosts (each starting at local_rank 0, so two ranks on one GPU); list it once "
                        f"with all its slots, e.g. -H {same[0].name}:{total}")
    if len(problems) == 1:
        raise SetupError(problems[0])
    if problems:
        for problem in problems[:-1]:
            output.error_line("hora run", problem)
        raise SetupError(problems[-1])


def run_on_host(host: str, transport: Transport, argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run ``argv`` on ``host`` within ``timeout`` s: (exit code, stdout, stderr). ``hora check`` uses it too.

    The exit code is None when the command did not finish in time (it is killed). ssh's own exit code
    :data:`SSH_FAILED` means it could not connect or authenticate.

    Raises:
        OSError: the command cannot start on this machine (no ssh client).
    """
    proc = transport.start(host, argv)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "", ""
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _probe_with_retries(host: str, transport: Transport, argv: list[str],
                        timeout: float) -> tuple[int | None, str, str, int]:
    """:func:`run_on_host`, tried again (with backoff, within ``timeout``) while sshd drops the connection before
    its handshake; returns (exit code, stdout, stderr, tries)."""
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        tries += 1
        code, out, err = run_on_host(host, transport, argv, max(deadline - time.monotonic(), 0.1))
        delay = SSH_RETRY_BACKOFF * 2 ** (tries - 1) * (1 + 0.5 * random.random())
        if code != SSH_FAILED or not _DROPPED.search(err) or tries > SSH_RETRIES \
                or time.monotonic() + delay >= deadline:
            return code, out, err, tries
        if tries == 1:
            output.note(f"host {host}: sshd dropped the connection before the handshake "
                        f"({err.strip().splitlines()[-1]}); trying again, up to {SSH_RETRIES} more times")
        time.sleep(delay)


def probe_host(host: str, transport: Transport, python: str, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run the probe on ``host``; return (its answer, "") or (None, the problem as one line)."""
    argv = [python, "-c", PROBE]
    reproduce = describe(transport.command(host, [python, "-V"]))
    try:
        code, out, err, tries = _probe_with_retries(host, transport, argv, timeout)
    except OSError as exc:
        return None, f"host {host}: cannot run {argv[0] if isinstance(transport, LocalTransport) else 'ssh'} " \
                     f"({exc.strerror or exc}); install openssh-client on this machine"
    if code is None:
        return None, f"host {host}: no answer within --start-timeout {timeout:g}s; try: {reproduce}"
    last_err = err.strip().splitlines()[-1:] or [""]
    if code == SSH_FAILED and _DROPPED.search(err):
        return None, (f"host {host}: sshd dropped the ssh connection before the handshake {tries} times "
                      f"({last_err[0]}): it does that when more connections wait to log in than its MaxStartups "
                      "allows (default 10:30:100), e.g. several jobs starting at once; raise MaxStartups in "
                      f"/etc/ssh/sshd_config on {host}, or start fewer jobs at once; try: {reproduce}")
    if code == SSH_FAILED:
        return None, f"host {host}: cannot connect over ssh ({last_err[0] or 'exit 255'}); try: {reproduce}"
    if code == 127:
        return None, (f"host {host}: {python} not found there; install the same Python environment at the "
                      "same path on every host")
    try:
        answer = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, f"host {host}: the probe failed (exit {code}: {last_err[0]}); try: {reproduce}"
    return answer, ""


def compare(host: str, answer: dict[str, Any], mine: dict[str, Any], python: str) -> list[str]:
    """Problems (one line each) where ``host``'s versions differ from the launcher's."""
    problems = []
    if answer.get("hora") is None:
        problems.append(f"host {host}: hora is not installed for {python}; install hora {mine['hora']} there")
    for key in VERSION_KEYS:
        theirs = answer.get(key)
        if theirs is not None and theirs != mine[key]:
            problems.append(f"host {host}: {key} {theirs}, but the launcher has {key} {mine[key]}; "
                            "install the same versions on every host")
    code = answer.get("code")  # None: an older hora's probe, which does not say
    if answer.get("hora") == mine["hora"] and code is not None and code != mine["code"]:
        short = code_fingerprint.short
        problems.append(f"host {host}: hora {mine['hora']} there is different code from the launcher's hora "
                        f"{mine['hora']} (code fingerprint {short(code)} there, {short(mine['code'])} here): install "
                        "the same hora build on every host (the same wheel, or one checkout on shared storage)")
    return problems


def check_hosts(cfg: RunConfig, transport_for: Callable[[str, bool], Transport],
                used: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Check every remote host (that gets ranks, when ``used`` is given) in parallel; return their answers.

    Raises:
        SetupError: (exit code 2) after printing one line per problem found.
    """
    remote = [h for h in cfg.hosts if not h.is_local and (used is None or h.name in used)]
    results: dict[str, tuple[dict[str, Any] | None, str]] = {}

    def probe(name: str) -> None:
        results[name] = probe_host(name, transport_for(name, False), cfg.python, cfg.start_timeout)

    threads = [threading.Thread(target=probe, args=(h.name,), daemon=True) for h in remote]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(cfg.start_timeout + 5)
    mine = local_versions()
    problems: list[str] = []
    for host in remote:
        answer, problem = results.get(host.name, (None, f"host {host.name}: preflight did not finish"))
        problems += [problem] if answer is None else compare(host.name, answer, mine, cfg.python)
        if answer is not None and isinstance(answer.get("cpus"), int) and host.slots > answer["cpus"]:
            log.warning("host %s: %d slots but %d CPUs", host.name, host.slots, answer["cpus"])
    if problems:
        for problem in problems:
            output.error_line("hora run", problem)
        raise SetupError(f"preflight found {len(problems)} problem(s); nothing was started")
    log.info("preflight passed for %s", ", ".join(h.name for h in remote))
    return {name: answer for name, (answer, _) in results.items() if answer is not None}
