"""Malformed ``hora run`` input: each gives one exact error line and exit code 2, and starts nothing.

Run in-process through :func:`hora.launcher.cli.main` (the code behind the ``hora`` command), plus a few
through a real ``python -m hora`` process to show the command itself behaves the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hora.errors import ConfigError
from hora.launcher.cli import main
from tests.launcher.helpers import HORA, PYTHON

P = sys.executable
OK = [P, "ok.py"]

CASES: list[tuple[list[str], str]] = [
    (["-H", "a:", *OK], "-H 'a:': missing slot count after ':' in 'a:'; write host:slots, e.g. a:2"),
    (["-H", "a:x", *OK], "-H 'a:x': slot count 'x' in 'a:x' is not an integer"),
    (["-H", "a:0", *OK], "-H 'a:0': host 'a' has 0 slots; each host needs at least 1 slot"),
    (["-H", "a:-2", *OK], "-H 'a:-2': host 'a' has -2 slots; each host needs at least 1 slot"),
    (["-H", "a:2,,b:2", *OK],
     "-H 'a:2,,b:2': empty host entry; write host:slots entries separated by commas, e.g. -H node1:4,node2:4"),
    (["-H", "a:1,a:1", *OK], "-H 'a:1,a:1': host 'a' is listed twice; list each host once with its total slot count"),
    (["-H", "fe80::1:2", *OK], "-H 'fe80::1:2': IPv6 address 'fe80::1:2' needs brackets, e.g. [fe80::1:2]:2"),
    (["-H", "bad host:2", *OK], "-H 'bad host:2': 'bad host' is not a valid host name or address"),
    (["-np", "5", "-H", "localhost:2", *OK],
     "-np 5 is more than the 2 slots the hosts offer; lower -np or add slots (-H host:slots)"),
    (["-np", "3", "-H", "node1,node2", *OK],
     "-np 3 is more than the 2 slots the hosts offer (node1, node2 are written without :slots, so 1 slot each); "
     "lower -np or add slots (-H host:slots)"),
    (["-np", "2", "-H", "localhost2", *OK],  # issue 33.6: a colon left out; said before any ssh, whatever -np
     "-H 'localhost2': host 'localhost2' does not resolve; did you mean localhost:2? Give slots as host:slots, "
     "with a colon (-H localhost:2)"),
    (["-np", "1", "-H", "localhost2", *OK],
     "-H 'localhost2': host 'localhost2' does not resolve; did you mean localhost:2? Give slots as host:slots, "
     "with a colon (-H localhost:2)"),
    (["-np", "0", *OK], "-np 0: the number of processes must be at least 1"),
    (["-np", "-1", *OK], "-np -1: the number of processes must be at least 1"),
    (["-np", "abc", *OK], "-np/--num-proc: invalid int value: 'abc'"),
    (["-np", "2", P, "missing.py"], "script 'missing.py' not found in {cwd}; check the path"),
    (["-np", "2"], "no command given; usage: hora run -np 2 python train.py"),
    (["-np", "2", "definitely-not-a-program-xyz"],
     ("command 'definitely-not-a-program-xyz' not found (not a file, not on PATH); check the spelling or give its "
     "full path")),
    (["--hostfile", "nofile", *OK], "--hostfile nofile: no such file"),
    (["--hostfile", "hf_dir", *OK], "--hostfile hf_dir: is a directory, not a hostfile"),
    (["--hostfile", "hf_badslots", *OK],
     "hostfile hf_badslots line 2: slot count 'two' in 'node1 slots=two' is not an integer"),
    (["--hostfile", "hf_badline", *OK],
     "hostfile hf_badline line 2: cannot read 'node1 slots'; write 'host slots=N' or 'host:N'"),
    (["--hostfile", "hf_bin", *OK], "--hostfile hf_bin: cannot read it (UnicodeDecodeError)"),
    (["--hostfile", "hf_dup", *OK],
     "hostfile hf_dup: host 'node1' is listed twice; list each host once with its total slot count"),
    (["-H", "a:1", "--hostfile", "hf_badline", *OK], "-H and --hostfile both given; use only one of them"),
    (["--hostfle", "h", *OK], "unknown flag --hostfle. Did you mean --hostfile?"),
    (["--num-procs", "2", *OK], "unknown flag --num-procs. Did you mean --num-proc?"),
    (["--mpi", *OK], ("--mpi: hora has no MPI controller (it runs on torch.distributed with Gloo/NCCL); drop the "
     "flag, or launch with mpirun directly (hora.init() reads Open MPI/MPICH variables)")),
    (["--mpi-args=-x FOO", *OK], ("--mpi-args: hora has no MPI controller (it runs on torch.distributed with "
     "Gloo/NCCL); drop the flag, or launch with mpirun directly (hora.init() reads Open MPI/MPICH variables)")),
    (["--jsrun", *OK], ("--jsrun: hora cannot launch through jsrun; use -H/--hostfile (ssh), or start ranks with "
     "jsrun yourself and let hora.init() read their environment")),
    (["--config-file", "nope.yaml", *OK], "--config-file nope.yaml: no such file"),
    (["--config-file", "bad.yaml", *OK], "--config-file bad.yaml: not valid YAML at line 2"),
    (["--config-file", "unknown.yaml", *OK], "--config-file unknown.yaml: unknown key 'nump'; did you mean 'np'?"),
    (["--config-file", "list.yaml", *OK], "--config-file list.yaml: expected a mapping of flag: value, got list"),
    (["--config-file", "type.yaml", *OK], "--config-file type.yaml: --num-proc value 'many' is not a valid int"),
    (["-p", "70000", "-H", "h1:1", *OK], "-p 70000: an ssh port is between 1 and 65535"),
    (["-i", "nokey", "-H", "h1:1", *OK], "-i nokey: no such file"),
    (["--start-timeout", "0", *OK], "--start-timeout 0: must be more than 0 seconds"),
    (["--heartbeat-timeout", "1", *OK],
     "--heartbeat-timeout 1: must be at least 3 seconds (the launcher pings every host every 2 seconds)"),
    (["--stall-check-warning-time-seconds", "-1", *OK], "--stall-check-warning-time-seconds -1: must not be negative"),
    (["-x", "1BAD=2", *OK], ("-x 1BAD=2: '1BAD' is not a valid environment variable name; write -x NAME or "
     "-x NAME=VALUE")),
    (["-x", "NOT_SET_ANYWHERE_XYZ", *OK], ("-x NOT_SET_ANYWHERE_XYZ: NOT_SET_ANYWHERE_XYZ is not set in the "
     "launcher's environment; set it or write -x NOT_SET_ANYWHERE_XYZ=VALUE")),
    (["--output-filename", "afile", *OK], ("--output-filename afile: exists and is not a directory; give a "
     "directory (logs go to DIR/rank.N/stdout|stderr)")),
    (["--output-filename", "afile/logs", *OK], ("--output-filename afile/logs: cannot write the logs there "
     "({cwd}/afile is a file, so nothing can be created under it); give a writable directory")),
    (["--timeline-filename", "hf_dir", *OK], ("--timeline-filename hf_dir: is a directory; give a file name, e.g. "
     "hf_dir/timeline.json")),
    (["--log-level", "LOUD", *OK], ("--log-level: invalid choice: 'LOUD' (choose from 'DEBUG', 'INFO', 'WARNING', "
     "'ERROR', 'CRITICAL', 'TRACE')")),
    (["--network-interface", "nosuch0", *OK], ("--network-interface nosuch0: no IPv4 address on this machine for "
     "that interface (interfaces: {ifaces}); pick one of them")),
    (["--min-np", "2", "--max-np", "1", *OK], "--max-np 1 is less than --min-np 2"),
    (["-np", "1", "--min-np", "2", *OK], "-np 1 is less than --min-np 2; -np is the number of slots to wait for "
     "before starting"),
    (["--min-np", "1", "--blacklist-cooldown-range", "5", "1", *OK], ("--blacklist-cooldown-range 5 1: give MIN MAX "
     "seconds with 0 <= MIN <= MAX")),
    (["--host-discovery-script", "d.sh", "-H", "a:1", *OK], ("--host-discovery-script and -H/--hostfile both given; "
     "an elastic job takes its hosts from one of them")),
    (["--reset-limit", "2", *OK], ("elastic flags without --host-discovery-script or --min-np: give --min-np N (with "
     "-H/--hostfile) or a --host-discovery-script")),
    (["--timeline-filename", "ok.py/t.json", *OK], "--timeline-filename ok.py/t.json: {cwd}/ok.py is not a directory"),
]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "ok.py").write_text("print('ok')\n")
    (tmp_path / "hf_badslots").write_text("a slots=2\nnode1 slots=two\n")
    (tmp_path / "hf_badline").write_text("# comment\nnode1 slots\n")
    (tmp_path / "hf_dup").write_text("node1 slots=2\n\nnode1:2  # again\n")
    (tmp_path / "hf_bin").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "hf_dir").mkdir()
    (tmp_path / "bad.yaml").write_text("np: [1\n")
    (tmp_path / "unknown.yaml").write_text("nump: 2\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "type.yaml").write_text("np: many\n")
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NOT_SET_ANYWHERE_XYZ", raising=False)
    return tmp_path


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[:2]) for a, _ in CASES])
def test_malformed_input_gives_one_exact_line_and_exit_code_2(
        argv: list[str], message: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hora.protocol.network import interface_addresses

    code = main(["run", *argv])
    captured = capsys.readouterr()
    expected = message.format(cwd=workdir, ifaces=", ".join(sorted(interface_addresses())))
    assert (code, captured.err, captured.out) == (2, f"hora run: error: {expected}\n", "")


def test_unknown_subcommand_suggests_the_right_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rnu", "-np", "2"]) == 2
    assert capsys.readouterr().err == ("hora: error: unknown command 'rnu'. Did you mean 'run'? usage: hora "
                                       "{run,check,bench,secret} ...   (hora run --help for the launcher's flags)\n")


def test_the_hora_command_prints_the_same_line(workdir: Path) -> None:
    # a real `python -m hora` process; also the horovodrun habit: no subcommand means `run`
    result = subprocess.run([P, "-m", "hora", "-np", "3", "-H", "localhost:2", P, "ok.py"], cwd=workdir,
                            capture_output=True, text=True, timeout=60, check=False)
    line = "hora run: error: -np 3 is more than the 2 slots the hosts offer; lower -np or add slots (-H host:slots)"
    assert (result.returncode, result.stderr, result.stdout) == (2, line + "\n", "")


def test_usage_errors_are_found_before_torch_is_imported(workdir: Path) -> None:
    """Issue 33.6: a usage error took 7-12 s at load 13, all of it torch's import; the command line is checked
    first, so the answer comes without it (no time asserted: whether torch was imported is what a user waits
    for)."""
    probe = ("import sys; from hora.launcher.cli import main; "
             "codes = [main(['run', '-np', '2', sys.executable, 'missing.py']), "
             "main(['run', '-np', '5', '-H', 'localhost:2', sys.executable, 'ok.py'])]; "
             "print(codes, 'torch' in sys.modules)")
    result = subprocess.run([P, "-c", probe], cwd=workdir, capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.strip() == "[2, 2] False", result.stdout + result.stderr


def test_a_host_with_a_left_out_colon_that_resolves_is_named_when_slots_run_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hora.launcher import hosts

    monkeypatch.setattr(hosts, "_resolves", lambda name, timeout_s=3.0: True)  # e.g. a localhost2 in /etc/hosts
    with pytest.raises(ConfigError) as raised:
        hosts.assign_slots(hosts.parse_hosts("localhost2"), 2)
    assert str(raised.value) == ("-np 2 is more than the 1 slot the hosts offer (localhost2 is written without :slots, "
                                 "so 1 slot each; did you mean localhost:2?); lower -np or add slots (-H host:slots)")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare(1)")
def test_read_only_output_directory_is_one_line_and_exit_code_2(workdir: Path) -> None:
    # a real read-only mount (a private mount namespace, so nothing outside this command sees it)
    logs = workdir / "logs"
    logs.mkdir()
    inner = f"mount --bind -o ro {logs} {logs} && exec {P} -m hora run -np 2 --output-filename {logs}/job {P} ok.py"
    result = subprocess.run(["unshare", "-m", "sh", "-c", inner], cwd=workdir, capture_output=True, text=True,
                            timeout=60, check=False)
    line = (f"hora run: error: --output-filename {logs}/job: cannot write the logs there ({logs} is on a read-only "
            "filesystem); give a writable directory")
    assert (result.returncode, result.stderr, result.stdout) == (2, line + "\n", "")


def test_hora_help_describes_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from hora.launcher.cli import DESCRIPTIONS, SUBCOMMANDS

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in DESCRIPTIONS, f"hora {name} has no description for hora --help"
        assert f"  {name} " in out and DESCRIPTIONS[name] in out
    assert "hora run -np 4 python train.py" in out and "--help" in out


# Runs in a network namespace of its own whose ephemeral port range (2 ports) is taken: the store cannot listen.
NO_FREE_PORT = """
import json, socket, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as fh:
    fh.write("40000 40001")
held = []
for port in (40000, 40001):
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(family)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port))
        s.listen()
        held.append(s)
done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)
print(json.dumps([done.returncode, done.stderr]))
"""


def test_a_store_that_cannot_listen_is_one_line_naming_the_address(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a network namespace of its own")
    done = subprocess.run(["unshare", "--net", PYTHON, "-c", NO_FREE_PORT, *HORA, "run", "-np", "1", PYTHON, "-V"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    code, err = json.loads(done.stdout)
    assert code == 2, err
    assert err == ("hora run: error: cannot start the rendezvous store for the workers to reach at 127.0.0.1 (on a "
                   "port the system picks): address already in use; no free port: every port of "
                   "net.ipv4.ip_local_port_range is taken on this machine; close what holds them, or widen the "
                   "range\n"), err
