"""``hora check``: the JSON and the table a user reads, for this machine and for several hosts."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from hora.launcher import check


def _table(text: str) -> list[dict[str, str]]:
    lines = text.splitlines()
    header = re.split(r"\s{2,}", lines[0])
    rows = []
    for line in lines[1:]:
        if ": " in line.split("  ")[0] or not line.strip() or line.startswith(("OK", "NOT OK", "MISMATCH")):
            break
        rows.append(dict(zip(header, re.split(r"\s{2,}", line))))
    return rows


def test_json_describes_this_machine(capsys):
    assert check.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (host,) = report["hosts"]
    assert report["ok"] is True and report["disagree"] == {}
    assert host["torch"] == torch.__version__
    assert host["backends"]["gloo"] == dist.is_gloo_available()
    assert host["backends"]["nccl"] == dist.is_nccl_available()
    assert host["cuda"]["available"] == torch.cuda.is_available()
    assert len(host["cuda"]["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    lo = [i for i in host["interfaces"] if i["name"] == "lo"]
    assert lo and any(a.startswith("127.0.0.1") for a in lo[0]["addresses"])


def test_table_describes_this_machine(capsys):
    assert check.main([]) == 0
    out = capsys.readouterr().out
    (row,) = _table(out)
    assert row["reachable"] == "yes"
    assert row["torch"] == torch.__version__
    assert row["gloo"] == ("yes" if dist.is_gloo_available() else "no")
    assert re.search(r": interfaces: .*lo 127\.0\.0\.1", out)
    assert out.rstrip().endswith("OK: every host answered and versions agree")
    assert "    [X] PyTorch" in out  # horovodrun --check-build's block, for the one-host case
    assert f"    [{'X' if dist.is_gloo_available() else ' '}] Gloo" in out.split("Available Tensor Operations:")[1]


def test_sysfs_fallback_finds_loopback():
    found = {i["name"]: i for i in check._sysfs_interfaces()}
    assert found["lo"]["up"] is True
    assert "127.0.0.1" in found["lo"]["addresses"]


def _fake_host(host: str, torch_version: str) -> dict:
    info = check.local_info()
    return {**info, "host": host, "torch": torch_version}


def test_hosts_disagreeing_on_torch_are_named():
    answers = {"a": _fake_host("a", "2.13.0"), "b": _fake_host("b", "2.4.1"), "c": None}

    def run_remote(host, argv):
        assert argv[1:] == ["-m", "hora.launcher.check", "--json"]
        if answers[host] is None:
            return 255, "", "ssh: connect to host c port 22: Connection refused"
        return 0, json.dumps({"hosts": [answers[host]]}), ""

    report = check.collect(["a", "b", "c"], run_remote)
    assert report["ok"] is False
    assert report["disagree"] == {"torch": {"2.13.0": ["a"], "2.4.1": ["b"]}}
    text = check.format_table(report)
    rows = {r["host"]: r for r in _table(text)}
    assert [rows[h]["reachable"] for h in "abc"] == ["yes", "yes", "NO"]
    assert (rows["a"]["torch"], rows["b"]["torch"]) == ("2.13.0", "2.4.1")
    assert "MISMATCH torch: 2.13.0 on a; 2.4.1 on b" in text
    assert "c: unreachable: ssh: connect to host c port 22: Connection refused" in text


def test_hosts_running_different_hora_code_under_one_version_are_named():
    mine = check.local_info()
    answers = {"a": mine, "b": {**mine, "host": "b", "code": "e" * 64}, "c": {**mine, "host": "c", "code": None}}
    report = check.collect(["a", "b", "c"], lambda host, argv: (0, json.dumps({"hosts": [answers[host]]}), ""))
    assert report["ok"] is False
    assert report["disagree"] == {"code": {mine["code"][:12]: ["a"], "e" * 12: ["b"]}}  # c: too old to say
    assert f"MISMATCH code: {mine['code'][:12]} on a; eeeeeeeeeeee on b" in check.format_table(report)


def test_hosts_over_the_real_command_with_one_unreachable(capsys):
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client here")
    rc = check.main(["-H", "localhost:2,nosuchhost.invalid:1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1
    local, bad = report["hosts"]
    assert (local["host"], local["reachable"], local["torch"]) == ("localhost", True, torch.__version__)
    assert (bad["host"], bad["reachable"]) == ("nosuchhost.invalid", False)
    assert "nosuchhost.invalid" in bad["error"]


def test_bad_host_list_is_a_clear_error(capsys):
    assert check.main(["-H", "a:0"]) == 2
    assert "at least 1 slot" in capsys.readouterr().err


def test_python_patch_releases_agree_minor_releases_do_not():
    hosts = [{"host": h, "reachable": True, "hora": "0.1.0", "torch": "2.13.0", "python": v}
             for h, v in (("a", "3.11.7"), ("b", "3.11.9"), ("c", "3.12.1"), ("d", None))]
    hosts[3]["reachable"] = False
    assert check.version_disagreements(hosts) == {"python": {"3.11": ["a", "b"], "3.12": ["c"]}}


def test_hostfile_hosts_are_checked(tmp_path, capsys):
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client here")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnosuchhost.invalid slots=4\n")
    assert check.main(["--hostfile", str(hostfile), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(h["host"], h["reachable"]) for h in report["hosts"]] == [("nosuchhost.invalid", False)]
    assert "(check -p/-i and that ssh nosuchhost.invalid works)" in report["hosts"][0]["error"]
