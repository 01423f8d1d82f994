"""Several "hosts" on one machine: network namespaces joined by a bridge, each with its own sshd.

A :class:`Cluster` is a hub namespace holding a bridge and N host namespaces (``10.78.0.<i>/24`` on
``eth0``), each running an sshd of its own (own host key, pid file, listen address, authorized keys in a
temp dir) inside its own UTS namespace, so ``ssh 10.78.0.3 hostname`` answers ``node3``. The hosts share
the filesystem (like an NFS home), so the same venv and code are visible on every host.

Names carry the pid of the process that built them (``hora<pid>x<token>h3``), so a later run can tell a
stale set (its builder is dead) from one in use by a concurrent run, and delete only the stale ones.

:meth:`Cluster.shape` limits every host's cable to a rate with tc's token bucket filter (tbf), so the wire,
not the CPU, is the limit (the benchmarks in benchmarks/shaped_links.py use it; :func:`shaping_missing`
says when the kernel cannot).

Needs root, ``iproute2``, ``openssh-server`` and ``util-linux`` (``unshare``, ``nsenter``); see
:func:`missing_requirements`. See TESTING.md, "Several hosts on one machine".

Example:
    >>> with Cluster.build([2, 3, 4]) as cluster:  # doctest: +SKIP
    ...     cluster.host(3).run(["hostname"]).stdout
    'node3\\n'
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.polling import wait_until

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Cluster", "Host", "Proc", "clean_stale", "delete_namespace", "missing_requirements", "shaping_missing"]

log = logging.getLogger(__name__)

SUBNET = "10.78.0"
NAME_RE = re.compile(r"^hora(\d+)x[0-9a-f]+(hub|h\d+)$")
SSHD = "/usr/sbin/sshd"
ETC_NETNS = Path("/etc/netns")  # `ip netns exec` bind-mounts ETC_NETNS/<ns>/hosts over /etc/hosts
TOOLS = ("ip", "ssh", "ssh-keygen", "unshare", "nsenter")


def missing_requirements() -> str | None:
    """Say why the cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "cluster tests need root (network namespaces); run them as root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not os.path.exists(SSHD):
        missing.append(SSHD)
    if missing:
        return f"cluster tests need {', '.join(missing)}: apt-get update && apt-get install -y openssh-server iproute2"
    return None


def shaping_missing() -> str | None:
    """Say why links cannot be shaped here (no ``tc``, or a kernel without the tbf qdisc), or None."""
    reason = missing_requirements()
    if reason is not None:
        return reason
    if shutil.which("tc") is None:
        return "shaped links need tc (iproute2): apt-get install -y iproute2"
    probe = f"hora{os.getpid()}x{secrets.token_hex(2)}probe"
    try:
        _sh(["ip", "netns", "add", probe])
        _sh(["ip", "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1"])
        out = _sh(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "d0", "root", "tbf", "rate", "1mbit",
                   "burst", "32kb", "latency", "50ms"], check=False)
        if out.returncode != 0:
            return f"the kernel has no tbf qdisc (tc said: {out.stderr.strip()}); links cannot be shaped here"
        return None
    finally:
        _sh(["ip", "netns", "del", probe], check=False)


def _sh(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(ns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.stdout.split() if p.strip().isdigit()]


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in ``ns`` (repeat: a dying parent may have just forked)."""
    for _ in range(20):
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    log.warning("processes still alive in %s after SIGKILL: %s", ns, _netns_pids(ns))


def delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it (and its /etc/netns files); quiet when already gone."""
    _kill_namespace(ns)
    _sh(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def clean_stale() -> list[str]:
    """Delete namespaces left by an earlier run whose builder process is dead; return their names."""
    out = _sh(["ip", "netns", "list"], check=False)
    names = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    names |= {p.name for p in ETC_NETNS.glob("hora*")}  # a run killed between the two deletions
    stale = []
    for name in names:
        match = NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            stale.append(name)
    # Hosts first (their sshd may hold the veth peer), then hubs.
    for name in sorted(stale, key=lambda n: n.endswith("hub")):
        delete_namespace(name)
    if stale:
        log.info("removed stale namespaces %s", stale)
    return stale


@dataclass(frozen=True)
class Proc:
    """One process seen in a host's namespace."""

    pid: int
    ppid: int
    cmdline: str


@dataclass
class Host:
    """One simulated host: a network namespace with its own sshd and hostname."""

    index: int
    ns: str
    hub: str
    addr: str
    hostname: str
    workdir: Path
    sshd: subprocess.Popen[bytes] | None = None

    @property
    def sshd_pid(self) -> int:
        """The pid of this host's listening sshd."""
        assert self.sshd is not None, "sshd not started"
        return self.sshd.pid

    def _enter(self, cmd: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        # Join the sshd's network, UTS (`hostname` says nodeN) and mount namespaces (its /etc/hosts
        # names every host); entering a mount namespace resets the cwd, hence --wd.
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", "-t", str(self.sshd_pid), "-n", "-u", "-m", f"--wd={where}", "--", *cmd]

    def run(
        self,
        cmd: Sequence[str],
        timeout: float = 60,
        check: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on this host and wait for it (text output captured)."""
        out = subprocess.run(
            self._enter(cmd, cwd), capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"on {self.hostname}: {' '.join(cmd)} -> {out.returncode}\n{out.stderr}")
        return out

    def popen(
        self, cmd: Sequence[str], cwd: str | os.PathLike[str] | None = None, **kwargs: object
    ) -> subprocess.Popen[str]:
        """Start ``cmd`` on this host without waiting (pipes are the caller's choice)."""
        return subprocess.Popen(self._enter(cmd, cwd), text=True, **kwargs)  # type: ignore[call-overload]

    def ps(self) -> list[Proc]:
        """Every process in this host's namespace except its listening sshd."""
        procs = []
        for pid in _netns_pids(self.ns):
            if pid == self.sshd_pid:
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # exited meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            procs.append(Proc(pid, ppid, _cmdline(pid)))
        return procs

    def ssh_sessions(self) -> list[Proc]:
        """The per-connection sshd processes (children of the listener): killing one drops a session."""
        return [p for p in self.ps() if p.cmdline.startswith("sshd") and p.ppid == self.sshd_pid]

    def link_down(self) -> None:
        """Pull the cable: the bridge-side end goes down, packets to and from this host vanish silently."""
        _sh(["ip", "-n", self.hub, "link", "set", f"v{self.index}", "down"])

    def link_up(self) -> None:
        """Plug the cable back in."""
        _sh(["ip", "-n", self.hub, "link", "set", f"v{self.index}", "up"])

    def shape(self, rate_mbit: float, latency_ms: float = 100.0) -> None:
        """Limit this host's cable to ``rate_mbit`` Mbit/s each way: a tc token bucket (tbf) on both ends of
        its veth (the host's egress and, on the bridge side, its ingress). Traffic between ranks on the same
        host (loopback) stays unshaped, as on a real machine."""
        rate = f"{rate_mbit:g}mbit"
        burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # 4 ms of line rate: smooth, yet enough for GSO
        tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", f"{latency_ms:g}ms"]
        _sh(["ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf])
        _sh(["ip", "netns", "exec", self.hub, "tc", "qdisc", "replace", "dev", f"v{self.index}", "root", *tbf])

    def unshape(self) -> None:
        """Remove the shaping of :meth:`shape` (both ends of the cable back to the default qdisc)."""
        _sh(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        _sh(["ip", "netns", "exec", self.hub, "tc", "qdisc", "del", "dev", f"v{self.index}", "root"], check=False)

    def kill_all(self) -> None:
        """SIGKILL every process on this host except its sshd."""
        for proc in self.ps():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Cluster:
    """A hub namespace with a bridge and several :class:`Host` namespaces; a context manager."""

    prefix: str
    tmp: Path
    hosts: list[Host] = field(default_factory=list)
    _closed: bool = False

    @property
    def hub(self) -> str:
        return f"{self.prefix}hub"

    @property
    def key(self) -> Path:
        """The throwaway user private key authorized on every host."""
        return self.tmp / "id_ed25519"

    @property
    def ssh_options(self) -> list[str]:
        """``-o`` options an ssh client needs here (ssh reads ~/.ssh from passwd, not $HOME)."""
        return [
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=5",
        ]

    @property
    def ssh_config(self) -> Path:
        """An ssh config file (``ssh -F``) with the same identity and options, for every host."""
        return self.tmp / "ssh_config"

    @property
    def ssh_args(self) -> list[str]:
        """Arguments for ``ssh`` to reach any host: identity, options, no user config."""
        return ["-F", "none", "-i", str(self.key), *self.ssh_options]

    def host(self, index: int) -> Host:
        """The host whose address ends in ``.index``."""
        for h in self.hosts:
            if h.index == index:
                return h
        raise KeyError(f"no host {index} in {[h.index for h in self.hosts]}")

    def shape(self, rate_mbit: float) -> None:
        """Limit every host's cable to ``rate_mbit`` Mbit/s each way (see :meth:`Host.shape`)."""
        for h in self.hosts:
            h.shape(rate_mbit)

    def unshape(self) -> None:
        """Undo :meth:`shape` on every host."""
        for h in self.hosts:
            h.unshape()

    def ps(self) -> dict[str, list[Proc]]:
        """Every host's processes (besides sshd), by hostname."""
        return {h.hostname: h.ps() for h in self.hosts}

    @classmethod
    def build(cls, indices: Sequence[int] = (2, 3, 4), tmp: Path | None = None) -> Cluster:
        """Create the namespaces, keys and sshds; on any error, undo what was done and re-raise."""
        clean_stale()
        prefix = f"hora{os.getpid()}x{secrets.token_hex(2)}"
        tmpdir = tmp if tmp is not None else Path(tempfile.mkdtemp(prefix="hora-cluster-"))
        cluster = cls(prefix=prefix, tmp=tmpdir)
        try:
            cluster._build(indices)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _build(self, indices: Sequence[int]) -> None:
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hora-cluster", "-f", str(self.key)])
        (self.tmp / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        options = [o.replace("=", " ") for o in self.ssh_options[1::2]]
        self.ssh_config.write_text("\n    ".join(["Host *", f"IdentityFile {self.key}", *options]) + "\n")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation dir
        _sh(f"ip netns add {self.hub}".split())
        _sh(f"ip -n {self.hub} link add br0 type bridge".split())
        _sh(f"ip -n {self.hub} link set br0 up".split())
        for i in indices:
            name = f"node{i}"
            ns, addr = f"{self.prefix}h{i}", f"{SUBNET}.{i}"
            self.hosts.append(Host(i, ns, self.hub, addr, name, self.tmp / name))
        names = "".join(f"{h.addr} {h.hostname}\n" for h in self.hosts)
        for host in self.hosts:
            # Every host resolves every hostname, as on a real cluster (torchrun, for one, needs it).
            (ETC_NETNS / host.ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / host.ns / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
            self._add_host(host)
        for host in self.hosts:
            self._wait_sshd(host)

    def _add_host(self, host: Host) -> None:
        host.workdir.mkdir(parents=True, exist_ok=True)
        _sh(f"ip netns add {host.ns}".split())
        _sh(f"ip link add eth0 netns {host.ns} type veth peer name v{host.index} netns {self.hub}".split())
        _sh(f"ip -n {self.hub} link set v{host.index} master br0 up".split())
        _sh(f"ip -n {host.ns} addr add {host.addr}/24 dev eth0".split())
        _sh(f"ip -n {host.ns} link set eth0 up".split())
        _sh(f"ip -n {host.ns} link set lo up".split())
        hostkey = host.workdir / "ssh_host_ed25519_key"
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)])
        conf = host.workdir / "sshd_config"
        conf.write_text(_sshd_config(host, hostkey, self.tmp / "authorized_keys"))
        with open(host.workdir / "sshd.log", "ab") as log_file:
            host.sshd = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    host.ns,
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f"hostname {host.hostname} && exec {SSHD} -D -e -f {conf}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )

    def _wait_sshd(self, host: Host, deadline_s: float = 20) -> None:
        probe = ["ssh", *self.ssh_args, host.addr, "hostname"]
        first, sshd = self.hosts[0], host.sshd
        assert sshd is not None
        answer = [""]

        def answered() -> bool:
            out = first.run(probe, timeout=15)
            answer[0] = out.stderr.strip()
            return out.returncode == 0 and out.stdout.strip() == host.hostname

        if wait_until(answered, timeout=deadline_s, step=0.1, unless=lambda: sshd.poll() is not None):
            return
        if sshd.poll() is not None:
            raise RuntimeError(f"sshd on {host.hostname} exited: {_tail(host.workdir / 'sshd.log')}")
        raise RuntimeError(f"sshd on {host.hostname} ({host.addr}) not answering: {answer[0]}"
                           f"\n{_tail(host.workdir / 'sshd.log')}")

    def close(self) -> None:
        """Tear everything down: sshds, every process in every namespace, the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.kill()
            pidfile = host.workdir / "sshd.pid"
            if pidfile.exists():
                try:
                    os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
                except (ValueError, ProcessLookupError):
                    pass
            delete_namespace(host.ns)
            if host.sshd is not None:
                host.sshd.wait(timeout=10)
        delete_namespace(self.hub)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sshd_config(host: Host, hostkey: Path, authorized: Path) -> str:
    return "\n".join(
        [
            f"ListenAddress {host.addr}",
            "Port 22",
            f"HostKey {hostkey}",
            f"PidFile {host.workdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "StrictModes no",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "MaxStartups 100",
            "MaxSessions 100",
            "LogLevel INFO",
            "",
        ]
    )


def _tail(path: Path, lines: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
