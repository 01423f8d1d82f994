"""``hora run`` through the real SshTransport against an sshd on this machine's own (non-loopback) address.

The multi-host cases (3 hosts, faults, orphans per host) live in tests/cluster; this one keeps ssh covered
where network namespaces are not available. Needs root and openssh-server; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hora.protocol.network import interface_addresses
from tests.launcher.helpers import PYTHON, hora_run
from tests.polling import wait_until

SSHD = "/usr/sbin/sshd"


def _address() -> str | None:
    hostname = socket.gethostname()
    for addr in interface_addresses().values():
        if not addr.startswith("127.") and addr != hostname:
            return addr
    return None


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    addr = _address()
    if os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None or addr is None:
        pytest.skip("needs root, openssh-server and a non-loopback IPv4 address")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    with socket.socket() as probe:  # a free port
        probe.bind((addr, 0))
        port = probe.getsockname()[1]
    (d / "sshd_config").write_text(
        f"ListenAddress {addr}\nPort {port}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n"
        "StrictModes no\nUsePAM no\n")
    os.makedirs("/run/sshd", exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.DEVNULL)
    def listening() -> bool:
        try:
            socket.create_connection((addr, port), timeout=1).close()
        except OSError:
            return False
        return True

    wait_until(listening, timeout=10, step=0.05)  # a test that needs it fails naming the ssh connection
    yield addr, port, d / "user_key"
    proc.kill()
    proc.wait()


def _ssh_flags(port: int, key: Path) -> list[str]:
    return ["-p", str(port), "-i", str(key), "--ssh-option", "StrictHostKeyChecking=no",
            "--ssh-option", "UserKnownHostsFile=/dev/null", "--ssh-option", "LogLevel=ERROR"]


def test_two_ranks_over_ssh_get_their_environment(sshd: tuple[str, int, Path], tmp_path: Path) -> None:
    addr, port, key = sshd
    code = ("import os; print(os.environ['HORA_RANK'], os.environ['HORA_HOSTNAME'], os.environ['HORA_STORE_ADDR'], "
            "os.environ['GLOO_SOCKET_IFNAME'], os.environ['SECRET_TOKEN'])")
    result = hora_run(["-np", "2", "-H", f"{addr}:2", *_ssh_flags(port, key), "-x", "SECRET_TOKEN=s3cr3t",
                       PYTHON, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    iface = next(name for name, a in interface_addresses().items() if a == addr)
    assert sorted(result.stdout.splitlines()) == [f"[{r}]<stdout>:{r} {addr} {addr} {iface} s3cr3t" for r in (0, 1)]


def test_unreachable_port_is_one_preflight_line_with_the_command_to_reproduce(
        sshd: tuple[str, int, Path], tmp_path: Path) -> None:
    addr, port, key = sshd
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind((addr, 0))
        closed = probe.getsockname()[1]
    result = hora_run(["-np", "1", "-H", f"{addr}:1", *_ssh_flags(closed, key), PYTHON, "-V"], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == (
        f"hora run: error: host {addr}: cannot connect over ssh (ssh: connect to host {addr} port {closed}: "
        f"Connection refused); try: ssh -o BatchMode=yes -p {closed} -i {key} -o StrictHostKeyChecking=no "
        f"-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=30 -o ServerAliveInterval=5 "
        f"-o ServerAliveCountMax=3 {addr} 'exec {PYTHON} -V'")
    assert lines[1:] == ["hora run: error: preflight found 1 problem(s); nothing was started"]
