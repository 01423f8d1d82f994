"""The CPU image for real (issue 14, items 1-2): podman containers on a user network, SSH on 2222 between them.

Each test checks what a user would see: a 2-node ``hora run`` training over SSH, a killed container named in the
launcher's report, key-only SSH, host keys made per container, JupyterLab refusing requests without its token,
a notebook calling ``hora.run(fn, num_proc=2)`` inside the container, and PID 1 forwarding signals and reaping.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tests.deploy import podman as pm
from tests.deploy.podman import Pair
from tests.polling import wait_until

pytestmark = pytest.mark.containers

TRAIN = ["hora", "run", "-np", "2", "-H", "node1:1,node2:1", "-p", "2222",
         "python", "/opt/hora/examples/train_digits.py", "--epochs", "1"]


def test_two_node_training_over_ssh_on_2222(pair: Pair) -> None:
    out = pair.nodes[0].exec(TRAIN, timeout=600, check=True)
    m = re.search(r"ranks: 2 .*test accuracy \(averaged over ranks\): ([0-9.]+)", out.stdout)
    assert m, out.stdout[-2000:]
    assert float(m.group(1)) > 0.5  # one epoch on digits: far above chance (0.1)


def test_mounted_keys_get_sshs_permissions_and_password_login_is_refused(pair: Pair) -> None:
    assert oct((pair.keys / "authorized_keys").stat().st_mode & 0o777) == "0o666"  # as mounted
    listing = pair.nodes[1].exec(["stat", "-c", "%a %U %n", "/home/hora/.ssh", "/home/hora/.ssh/authorized_keys",
                                  "/home/hora/.ssh/id_ed25519"], check=True).stdout.split("\n")
    assert listing[:3] == ["700 hora /home/hora/.ssh", "600 hora /home/hora/.ssh/authorized_keys",
                           "600 hora /home/hora/.ssh/id_ed25519"]
    denied = pair.nodes[0].exec(["ssh", "-p", "2222", "-o", "BatchMode=yes", "-o", "PubkeyAuthentication=no",
                                 "-o", "PreferredAuthentications=password,keyboard-interactive", "node2", "true"])
    assert denied.returncode == 255
    assert "Permission denied (publickey)" in denied.stderr  # the only method sshd offers
    with_key = pair.nodes[0].exec(["ssh", "-p", "2222", "node2", "hostname"], check=True)
    assert with_key.stdout.strip() == "node2"


def test_host_keys_are_made_at_first_start_not_baked_in(image: str, pair: Pair) -> None:
    baked = pm.podman("run", "--rm", *pm.LIMITS, "--entrypoint", "sh", image, "-c",
                      "ls /etc/ssh/ | grep -c ssh_host_ || true").stdout.strip()
    assert baked == "0"
    prints = {node.exec(["ssh-keygen", "-lf", "/home/hora/.sshd/ssh_host_ed25519_key.pub"], check=True).stdout
              for node in pair.nodes}
    assert len(prints) == 2


LOOP = """\
import pathlib, sys, time, torch, hora
hora.init()
for step in range(100000):
    hora.allreduce(torch.ones(4), name=f"s{step % 4}")
    if step == 1:
        pathlib.Path(f"/data/ready-{hora.rank()}").touch()
    time.sleep(0.05)
"""


def _wait_until_reachable(node: pm.Container, host: str, port: int, timeout: float = 60) -> None:
    """Wait until ``node`` resolves ``host`` and connects to its port: a container that has just started can
    log "Server listening" before the network's DNS answers for its name (hora run then fails preflight)."""
    probe = f"import socket; socket.create_connection(({host!r}, {port}), 2).close()"
    assert wait_until(lambda: _probe(node, probe), timeout=timeout, step=0.5), (
        f"{node.name} cannot reach {host}:{port} after {timeout:.0f} s")


def _probe(node: pm.Container, probe: str) -> bool:
    """One try; a ``podman exec`` that hangs (seen once in CI, 30 s) counts as a failed try, not an error."""
    try:
        return node.exec(["python", "-c", probe], timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def test_killed_container_is_reported_with_its_host(image: str, pair: Pair) -> None:
    (pair.data / "loop.py").write_text(LOOP)
    victim = pm.run_container("node3", image, ["sshd"], network=pair.network,
                              volumes=[f"{pair.keys}:/etc/hora/ssh:ro", f"{pair.data}:/data"])
    try:
        victim.wait_for_log("Server listening")
        _wait_until_reachable(pair.nodes[0], "node3", 2222)
        job = subprocess.Popen([*pm.PODMAN, "exec", pair.nodes[0].name, "hora", "run", "-np", "2", "-H",
                                "node1:1,node3:1", "-p", "2222", "python", "/data/loop.py"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if not wait_until(lambda: all((pair.data / f"ready-{r}").exists() for r in (0, 1)), timeout=240, step=0.5,
                          unless=lambda: job.poll() is not None):
            job.kill()
            output, _ = job.communicate(timeout=60)
            raise AssertionError(f"the job never got going (exit {job.returncode}):\n{output[-3000:]}")
        pm.podman("kill", victim.name)
        output, _ = job.communicate(timeout=180)
    finally:
        victim.remove()
    assert job.returncode != 0
    assert re.search(r"rank 1 on host node3\b", output), output[-3000:]


NOTEBOOK_CELL = """\
import hora

def where(x):
    import socket
    hora.init()
    out = (hora.rank(), hora.size(), hora.allreduce(__import__('torch').tensor([x + hora.rank()]), op=hora.Sum).item())
    hora.shutdown()
    return out

results = hora.run(where, args=(10.0,), num_proc=2)
print(results)
"""


def test_notebook_runs_hora_run_with_two_ranks_in_the_container(pair: Pair) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(NOTEBOOK_CELL))
    nbformat.write(nb, str(pair.data / "ranks.ipynb"))
    pair.nodes[0].exec(["jupyter", "nbconvert", "--to", "notebook", "--execute", "/data/ranks.ipynb",
                        "--output", "/data/ranks.out.ipynb"], timeout=300, check=True)
    done = nbformat.read(str(pair.data / "ranks.out.ipynb"), as_version=4)
    text = "".join(o.get("text", "") for o in done.cells[0].outputs if o.get("output_type") == "stream")
    assert "[(0, 2, 21.0), (1, 2, 21.0)]" in text, done.cells[0].outputs


def _get(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_jupyterlab_prints_a_generated_token_and_refuses_requests_without_it(image: str, pair: Pair) -> None:
    lab = pm.run_container("lab", image, ["jupyter"], network=pair.network)
    try:
        logs = lab.wait_for_log("is running at", timeout=180)
        m = re.search(r"JupyterLab token \(generated\): ([0-9a-f]{48})", logs)
        assert m, logs[-2000:]
        url = f"http://{lab.ip()}:8888/api/contents"
        assert _get(url) == 403
        assert _get(url, "not-the-token") == 403
        assert _get(url, m.group(1)) == 200
    finally:
        lab.remove()
    refused = pm.podman("run", "--rm", *pm.LIMITS, "-e", "JUPYTER_TOKEN=", image, "jupyter", check=False, timeout=120)
    assert refused.returncode == 2
    assert "refusing to start JupyterLab without authentication" in refused.stderr


TRAP = ("trap 'echo got TERM > /data/signal; exit 0' TERM; "
        "sh -c 'sleep 0.2 & exit 0'; sleep 2; ps -eo stat= > /data/states; sleep 600 & wait")


def test_pid1_reaps_orphans_and_forwards_signals(image: str, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    box = pm.run_container("pid1", image, ["bash", "-c", TRAP], volumes=[f"{tmp_path}:/data"])
    try:
        assert wait_until((tmp_path / "states").exists, timeout=120, step=0.3), "the container never wrote its states"
        assert not any(s.startswith("Z") for s in (tmp_path / "states").read_text().split()), "a zombie was left"
        pm.podman("stop", "-t", "60", box.name, timeout=120)
        code = pm.podman("inspect", "--format", "{{.State.ExitCode}}", box.name).stdout.strip()
    finally:
        box.remove()
    assert (tmp_path / "signal").read_text().strip() == "got TERM"
    assert code == "0"  # the trap's exit, not a SIGKILL after the grace period


def test_run_mode_and_exec_mode(image: str) -> None:
    out = pm.podman("run", "--rm", *pm.LIMITS, image, "run", "-np", "2", "python", "-c",
                    "import hora; hora.init(); print('rank', hora.rank(), 'of', hora.size())", timeout=300)
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout, out.stdout + out.stderr
    check = pm.podman("run", "--rm", *pm.LIMITS, image, "hora", "check", timeout=300, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    info = json.loads(pm.podman("image", "inspect", image).stdout)[0]
    assert info["Config"]["User"] == "hora"
    assert set(info["Config"]["Volumes"]) >= {"/data", "/checkpoints"}
