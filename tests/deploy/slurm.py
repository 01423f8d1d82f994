"""A real Slurm cluster on one machine: slurmctld on the host, one slurmd per network namespace.

Each node is a network namespace (``10.79.<k>.1x`` behind a bridge whose host side, ``10.79.<k>.1``, is
where slurmctld listens) with its own hostname (a UTS namespace; slurmd finds its NodeName from it) and its
own ``/etc/hosts`` and spool directory (a private mount namespace with bind mounts). slurmd is started with
``nsenter --net``, not ``ip netns exec``: the latter remounts /sys, which breaks slurmd's start-up. munged
runs privately on a socket in the cluster's temporary directory, with its own key.

``lost1`` is a node whose name is in nobody's hosts file (Slurm reaches it by its NodeAddr), to show what a
job sees when the first node's name does not resolve.

Needs root, slurm-wlm, munge, iproute2 and util-linux; :func:`missing_requirements` says what is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.polling import wait_until

TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "munged", "ip", "nsenter", "unshare")
NODES = ("node1", "node2", "node3", "lost1")
RESOLVABLE = ("node1", "node2", "node3")
_UNFINISHED = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


def missing_requirements() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (network namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"the Slurm cluster needs {', '.join(missing)}: run `make system-deps` as root (slurm-wlm, munge)"
    return None


def _sh(*argv: str, check: bool = True, timeout: float = 30, **kw: object) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kw)  # type: ignore[call-overload]
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out


@dataclass
class SlurmCluster:
    tmp: Path
    tag: str = field(default_factory=lambda: f"s14{os.getpid() % 100000}")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def subnet(self) -> str:
        return f"10.79.{os.getpid() % 250}"

    @property
    def conf(self) -> Path:
        return self.tmp / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def addr(self, node: str) -> str:
        return f"{self.subnet}.{11 + NODES.index(node)}"

    # ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._network()
        self._munge()
        self._config()
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], self.tmp / "slurmctld.out")
        for node in NODES:
            self._slurmd(node)
        self._wait_idle()

    def _network(self) -> None:
        bridge = f"{self.tag}br"
        _sh("ip", "link", "add", bridge, "type", "bridge")
        self.namespaces.append(f"link:{bridge}")
        _sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for i, node in enumerate(NODES):
            ns = f"{self.tag}{node}"
            _sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            host_end, node_end = f"{self.tag}h{i}", f"{self.tag}n{i}"
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _sh("ip", "link", "set", host_end, "master", bridge, "up")
            _sh("ip", "link", "set", node_end, "netns", ns)
            _sh("ip", "-n", ns, "link", "set", node_end, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # No default route: names outside the hosts file fail at once (no DNS server to wait for).
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(n)} {n}\n" for n in RESOLVABLE)
        hosts += f"{self.subnet}.1 {socket.gethostname()}\n"
        (self.tmp / "hosts").write_text(hosts)

    def _munge(self) -> None:
        key = self.tmp / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.munge_socket = self.tmp / "munge.socket"
        _sh("munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.tmp / 'munged.pid'}", f"--log-file={self.tmp / 'munged.log'}",
            f"--seed-file={self.tmp / 'munged.seed'}")

    def _config(self) -> None:
        base = os.getpid() % 2000
        (self.tmp / "node").mkdir()  # each slurmd sees its own directory here (a bind mount)
        (self.tmp / "state").mkdir()
        nodes = "".join(f"NodeName={n} NodeAddr={self.addr(n)} CPUs={os.cpu_count()} State=UNKNOWN\n"
                        for n in NODES)
        self.conf.write_text(f"""\
ClusterName=hora{self.tag}
SlurmctldHost={socket.gethostname()}({self.subnet}.1)
SlurmctldPort={40000 + base}
SlurmdPort={42500 + base}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.tmp / 'state'}
SlurmctldPidFile={self.tmp / 'slurmctld.pid'}
SlurmctldLogFile={self.tmp / 'slurmctld.log'}
SlurmdSpoolDir={self.tmp / 'node' / 'spool'}
SlurmdPidFile={self.tmp / 'node' / 'slurmd.pid'}
SlurmdLogFile={self.tmp / 'node' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, argv: list[str], log: Path) -> None:
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                               start_new_session=True))

    def _slurmd(self, node: str) -> None:
        own = self.tmp / "nodes" / node
        own.mkdir(parents=True)
        (own / "spool").mkdir()
        script = (f"hostname {node} && mount --bind {self.tmp / 'hosts'} /etc/hosts && "
                  f"mount --bind {own} {self.tmp / 'node'} && exec slurmd -D -f {self.conf}")
        self._spawn(["nsenter", f"--net=/run/netns/{self.tag}{node}", "--", "unshare", "--uts", "--mount",
                     "--propagation", "private", "sh", "-c", script], own / "slurmd.out")

    def _wait_idle(self, timeout: float = 60) -> None:
        shown: dict[str, Any] = {}

        def idle() -> bool:
            out = _sh("sinfo", "-h", "-N", "-o", "%N %t", check=False, env=self.env())
            shown.update(states=dict(line.split() for line in out.stdout.splitlines() if line.strip()), err=out.stderr)
            return len(shown["states"]) == len(NODES) and all(s == "idle" for s in shown["states"].values())

        if not wait_until(idle, timeout=timeout, step=0.3):
            raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {shown['states'] or shown['err']}\n"
                               f"{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in [self.tmp / "slurmctld.log", *sorted((self.tmp / "nodes").glob("*/slurmd.log"))]:
            if path.exists():
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def sbatch(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``sbatch ARGS`` from the host; returns when the job ended, with the job's exit code.

        Not ``sbatch --wait``: it asks slurmctld every 2 to 10 s, which added 20-30 s to every job here; this
        asks ``scontrol`` twice a second."""
        submitted = _sh("sbatch", "--parsable", *args, check=False, timeout=60, env=self.env(), cwd=str(self.tmp))
        if submitted.returncode != 0:
            return submitted
        job = submitted.stdout.strip().split(";")[0]
        shown = [""]

        def ended() -> bool:
            shown[0] = _sh("scontrol", "show", "job", "-o", job, check=False, env=self.env()).stdout
            state = re.search(r"\bJobState=(\S+)", shown[0])
            return state is not None and state.group(1) not in _UNFINISHED

        if not wait_until(ended, timeout=timeout, step=0.5):
            raise subprocess.TimeoutExpired(["sbatch", *args], timeout, shown[0])
        code = re.search(r"\bExitCode=(\d+):(\d+)", shown[0])
        status, signal = (int(code.group(1)), int(code.group(2))) if code else (1, 0)
        return subprocess.CompletedProcess(["sbatch", *args], status or (128 + signal if signal else 0),
                                           submitted.stdout, submitted.stderr)

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        pid = self.tmp / "munged.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text().strip()), 15)
            except (ProcessLookupError, ValueError):
                pass
        for ns in reversed(self.namespaces):
            if ns.startswith("link:"):
                _sh("ip", "link", "del", ns[5:], check=False)
            else:
                for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(p), 9)
                    except ProcessLookupError:
                        pass
                _sh("ip", "netns", "del", ns, check=False)
        self.procs.clear()
        self.namespaces.clear()
