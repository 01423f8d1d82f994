"""``hora check``: what hora, Python, torch, backends, CUDA and network this machine (or every host) has.

``hora check`` describes this machine; ``hora check -H a:4,b:4`` (or ``--hostfile``) runs the same on every
host over ssh and adds reachability and version agreement. Hosts are read, reached and run as
``hora run``'s preflight does (:mod:`hora.launcher.hosts`, :func:`hora.launcher.remote.preflight.run_on_host`).
``--json`` prints one JSON object instead of the table. The exit code is 0 when every host answered and
hora, torch and Python agree, else 1.

Example:
    $ hora check --json | python -c 'import json,sys; print(json.load(sys.stdin)["hosts"][0]["torch"])'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import ConfigError
from hora.launcher.hosts import HostSpec, hosts_from
from hora.launcher.remote.preflight import hora_version, run_on_host
from hora.launcher.remote.transport import SSH_FAILED, SshTransport, transport_for
from hora.protocol.code_fingerprint import code_fingerprint, short
from hora.protocol.network import interface_addresses

log = logging.getLogger(__name__)

AGREE_KEYS = ("hora", "torch", "python", "code")  # code: hora's code fingerprint (one version, two builds)
RemoteRunner = Callable[[str, Sequence[str]], "tuple[int, str, str]"]  # host, argv -> rc, stdout, stderr


def _backends() -> dict[str, Any]:
    out: dict[str, Any] = {"distributed": dist.is_available()}
    if not dist.is_available():
        return out | {"gloo": False, "nccl": False, "mpi": False, "ucc": False}
    out["gloo"] = dist.is_gloo_available()
    out["nccl"] = dist.is_nccl_available()
    out["mpi"] = dist.is_mpi_available()
    out["ucc"] = bool(getattr(dist, "is_ucc_available", lambda: False)())
    if out["nccl"]:
        try:
            out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - NCCL present but not loadable without a GPU
            out["nccl_version"] = None
    return out


def _cuda() -> dict[str, Any]:
    info: dict[str, Any] = {"built": torch.version.cuda, "available": torch.cuda.is_available(), "devices": []}
    if info["available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1)})
    return info


def _ip_json() -> list[dict[str, Any]] | None:
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        raw = subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, timeout=5, check=True).stdout
        data = json.loads(raw)
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return None
    return [
        {
            "name": d.get("ifname", "?"),
            "up": "UP" in d.get("flags", []),
            "mtu": d.get("mtu"),
            "addresses": [f"{a['local']}/{a.get('prefixlen', '')}" for a in d.get("addr_info", []) if "local" in a],
        }
        for d in data
    ]


def _sysfs_interfaces() -> list[dict[str, Any]]:
    v6: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, plen, _, _, name = line.split()
                addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hexaddr))
                v6.setdefault(name, []).append(f"{addr}/{int(plen, 16)}")
    except OSError:
        pass
    out = []
    v4s = interface_addresses()
    for name in sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []:
        def read(attr: str, name: str = name) -> str:
            try:
                with open(f"/sys/class/net/{name}/{attr}") as f:
                    return f.read().strip()
            except OSError:
                return ""
        v4 = v4s.get(name)
        flags = int(read("flags") or "0", 16)
        out.append({"name": name, "up": bool(flags & 1), "mtu": int(read("mtu") or 0) or None,
                    "addresses": ([v4] if v4 else []) + v6.get(name, [])})
    return out


def network_interfaces() -> list[dict[str, Any]]:
    """Every network interface: name, up, mtu, addresses (``addr/prefix``; prefix missing from sysfs v4)."""
    found = _ip_json()
    return found if found is not None else _sysfs_interfaces()


def local_info() -> dict[str, Any]:
    """This machine's facts as a JSON-able dict (one entry of ``hora check --json``'s ``hosts``)."""
    return {
        "host": socket.gethostname(),
        "reachable": True,
        "hora": hora_version(),
        "code": code_fingerprint(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "backends": _backends(),
        "cuda": _cuda(),
        "interfaces": network_interfaces(),
    }


def version_disagreements(hosts: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """For each of hora/torch/python/code with more than one value among reachable hosts: value -> hosts.

    Python must agree on major.minor only (pickled functions and bytecode care; patch releases do not). The
    code fingerprint shows as its first 12 digits; a host whose hora is too old to report one is left out.
    """
    out: dict[str, dict[str, list[str]]] = {}
    for key in AGREE_KEYS:
        seen: dict[str, list[str]] = {}
        for h in hosts:
            if h.get("reachable") and (key != "code" or h.get("code")):
                value = str(h.get(key))
                if key == "python":
                    value = ".".join(value.split(".")[:2])
                if key == "code":
                    value = short(value)
                seen.setdefault(value, []).append(h["host"])
        if len(seen) > 1:
            out[key] = seen
    return out


def _yes(v: Any) -> str:
    return "yes" if v else "no"


def _row(h: dict[str, Any]) -> list[str]:
    if not h.get("reachable"):
        return [h["host"], "NO"] + ["-"] * 7
    b, c = h.get("backends", {}), h.get("cuda", {})  # .get: an older hora on that host may say less
    nccl = (b.get("nccl_version") or "yes") if b.get("nccl") else "no"
    cuda = (c.get("built") or "yes") if c.get("available") else ("built " + c["built"] if c.get("built") else "no")
    return [h["host"], "yes", str(h.get("hora", "?")), str(h.get("python", "?")), str(h.get("torch", "?")),
            _yes(b.get("gloo")), nccl,
            _yes(b.get("mpi")), f"{cuda} ({len(c.get('devices', []))} GPUs)"]


def format_table(report: dict[str, Any]) -> str:
    """The readable form of a :func:`collect` report."""
    header = ["host", "reachable", "hora", "python", "torch", "gloo", "nccl", "mpi", "cuda"]
    rows = [header] + [_row(h) for h in report["hosts"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for h in report["hosts"]:
        if not h.get("reachable"):
            lines.append(f"{h['host']}: unreachable: {h.get('error', '')}")
            continue
        for d in h.get("cuda", {}).get("devices", []):
            lines.append(f"{h['host']}: GPU {d['index']}: {d['name']} ({d['memory_gb']} GB)")
        ifs = ", ".join(f"{i['name']} {' '.join(i['addresses']) or '(no address)'}{'' if i['up'] else ' (down)'}"
                        for i in h.get("interfaces", []))
        lines.append(f"{h['host']}: interfaces: {ifs}")
    for key, seen in report["disagree"].items():
        lines.append(f"MISMATCH {key}: " + "; ".join(f"{v} on {', '.join(hs)}" for v, hs in seen.items()))
    if len(report["hosts"]) == 1 and report["hosts"][0].get("reachable"):
        lines += _horovod_style(report["hosts"][0])
    lines.append("OK: every host answered and versions agree" if report["ok"] else "NOT OK (see above)")
    return "\n".join(lines)


def _horovod_style(h: dict[str, Any]) -> list[str]:
    """``horovodrun --check-build``'s block, for scripts and eyes used to it."""
    b = h.get("backends", {})

    def box(ok: Any, name: str) -> str:
        return f"    [{'X' if ok else ' '}] {name}"

    return [f"hora v{h.get('hora', '?')} (horovodrun --check-build style):", "Available Frameworks:",
            box(False, "TensorFlow"), box(True, "PyTorch"), box(False, "MXNet"), "Available Controllers:",
            box(False, "MPI"), box(True, "Gloo"), "Available Tensor Operations:", box(b.get("nccl"), "NCCL"),
            box(False, "DDL"), box(False, "CCL"), box(b.get("mpi"), "MPI"), box(b.get("gloo"), "Gloo")]


def collect(hosts: Sequence[str] = (), run_remote: RemoteRunner | None = None) -> dict[str, Any]:
    """This machine's facts, or every host's over ``run_remote``, plus agreement.

    Args:
        hosts: host names or addresses; empty for this machine only.
        run_remote: runs ``argv`` on a host and returns (exit code, stdout, stderr).
    """
    if not hosts:
        infos = [local_info()]
    else:
        assert run_remote is not None, "collect(hosts=...) needs run_remote"
        with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:  # hosts answer in parallel
            infos = list(pool.map(lambda h: _remote_info(h, run_remote), hosts))
    disagree = version_disagreements(infos)
    ok = all(h.get("reachable") for h in infos) and not disagree
    return {"hosts": infos, "disagree": disagree, "ok": ok}


def _remote_info(host: str, run_remote: RemoteRunner) -> dict[str, Any]:
    argv = [sys.executable, "-m", "hora.launcher.check", "--json"]
    try:
        rc, out, err = run_remote(host, argv)
    except Exception as e:  # noqa: BLE001 - any transport failure means unreachable
        return {"host": host, "reachable": False, "error": str(e)}
    if rc != 0:
        tail = (err.strip().splitlines() or [f"exit code {rc}"])[-1]
        if rc == SSH_FAILED:  # ssh's own failure: cannot connect or authenticate
            return {"host": host, "reachable": False, "error": f"{tail} (check -p/-i and that ssh {host} works)"}
        hint = " (install the same hora there)" if "No module named" in tail else ""
        return {"host": host, "reachable": False, "error": f"`{' '.join(argv)}` failed: {tail}{hint}"}
    try:
        info = dict(json.loads(out)["hosts"][0])
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        return {"host": host, "reachable": False, "error": f"unreadable answer: {out[:200]!r}"}
    info["hostname"], info["host"] = info.get("host"), host
    return info


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``hora check``'s flags (added to ``parser`` when the CLI registers the subcommand)."""
    p = parser or argparse.ArgumentParser(
        prog="hora check", description="What hora, Python, torch, Gloo/NCCL/MPI, CUDA and network interfaces "
        "this machine (or every host given with -H/--hostfile, over ssh) has, and whether versions agree.")
    p.add_argument("-H", "--hosts", default=None, help="host:slots,... to check over ssh")
    p.add_argument("--hostfile", default=None, help="file of `host slots=N` lines to check over ssh")
    p.add_argument("-p", "--ssh-port", type=int, default=None, help="ssh port")
    p.add_argument("-i", "--ssh-identity-file", default=None, help="ssh identity file")
    p.add_argument("--ssh-option", action="append", metavar="OPTION", help="extra ssh -o option (repeatable)")
    p.add_argument("--ssh-config-file", default=None, help="ssh config file (ssh -F)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hora check``; returns the exit code (0 = every host answered and versions agree)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run(args)


def hosts_from_args(args: argparse.Namespace) -> list[str]:
    """Host names from ``-H``/``--hostfile``, read as ``hora run`` reads them; empty when neither is given."""
    if args.hosts is None and args.hostfile is None:
        return []
    return [h.name for h in hosts_from(args.hosts, args.hostfile)]


def ssh_runner(args: argparse.Namespace, timeout_s: float = 60.0) -> RemoteRunner:
    """Run argv on a host as ``hora run``'s preflight does: locally for this machine's names, else over ssh."""
    pick = transport_for(SshTransport(port=args.ssh_port, identity_file=args.ssh_identity_file,
                                      options=tuple(args.ssh_option or ()), config_file=args.ssh_config_file))

    def run_remote(host: str, argv: Sequence[str]) -> tuple[int, str, str]:
        code, out, err = run_on_host(host, pick(host, HostSpec(host, 1).is_local), list(argv), timeout_s)
        return (SSH_FAILED, "", f"no answer within {timeout_s:.0f} s") if code is None else (code, out, err)

    return run_remote


def run(args: argparse.Namespace) -> int:
    """``hora check`` on parsed arguments (the CLI's subcommand entry point)."""
    try:
        hosts = hosts_from_args(args)
    except ConfigError as e:
        sys.stderr.write(f"hora check: {e}\n")
        return e.exit_code
    report = collect(hosts, ssh_runner(args) if hosts else None)
    out = json.dumps(report, indent=2) if args.json else format_table(report)
    sys.stdout.write(out + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
