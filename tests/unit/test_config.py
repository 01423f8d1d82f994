"""``hora run`` flags -> RunConfig: the frozen flag set, knobs for workers, config files, env forwarding,
ssh command lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hora.common.knobs import Knobs
from hora.errors import ConfigError
from hora.launcher import config as run_config
from hora.launcher import envvars
from hora.launcher.cli import build_parser, parse_run_args
from hora.launcher.hosts import HostSpec, SlotInfo
from hora.launcher.remote.transport import SshTransport

FLAGS = [
    "--autotune", "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise", "--autotune-log-file",
    "--autotune-steps-per-sample", "--autotune-warmup-samples", "--binding-args", "--blacklist-cooldown-range",
    "--cache-capacity", "--check-build", "--config-file", "--cycle-time-ms", "--disable-cache", "--elastic-timeout",
    "--fusion-threshold-mb", "--gloo", "--gloo-timeout-seconds", "--grace-period", "--heartbeat-timeout", "--help",
    "--hierarchical-allgather", "--hierarchical-allreduce", "--host-discovery-script", "--hostfile", "--hosts",
    "--jsrun", "--log-hide-timestamp", "--log-level", "--log-with-timestamp", "--log-without-timestamp", "--max-np",
    "--max-num-proc", "--min-np", "--min-num-proc", "--mpi", "--mpi-args", "--mpi-threads-disable",
    "--network-interface", "--network-interfaces", "--no-autotune", "--no-hierarchical-allgather",
    "--no-hierarchical-allreduce", "--no-log-hide-timestamp", "--no-mpi-threads-disable", "--no-stall-check",
    "--no-timeline-mark-cycles", "--no-torus-allreduce", "--num-nccl-streams", "--num-proc", "--output-filename",
    "--prefix-output-with-timestamp", "--reset-limit", "--slots-per-host", "--ssh-config-file", "--ssh-identity-file",
    "--ssh-option", "--ssh-port", "--stall-check", "--stall-check-shutdown-time-seconds",
    "--stall-check-warning-time-seconds", "--start-timeout", "--tcp", "--thread-affinity", "--timeline-filename",
    "--timeline-mark-cycles", "--torus-allreduce", "--verbose", "--version", "-H", "-cb", "-h", "-hostfile", "-i",
    "-np", "-p", "-prefix-timestamp", "-v", "-x",
]


def test_the_set_of_flags_is_frozen() -> None:
    """A new flag is a decision: add it here and to docs/launcher.md."""
    assert sorted(s for a in build_parser()._actions for s in a.option_strings) == FLAGS


def _cfg(argv: list[str], environ: dict[str, str] | None = None) -> run_config.RunConfig:
    return run_config.from_args(parse_run_args(argv), environ if environ is not None else {"PATH": "/usr/bin"})


def test_horovodrun_tuning_flags_become_worker_knobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(["-np", "2", "--timeline-filename", "t.json", "--timeline-mark-cycles", "--no-stall-check",
                "--stall-check-warning-time-seconds", "5", "--stall-check-shutdown-time-seconds", "30",
                "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "0",
                "--log-level", "debug",
                "--start-timeout", "45", "--gloo", "--hierarchical-allreduce", sys.executable, "-V"])
    knobs = Knobs.from_environ(cfg.env)
    assert (knobs.timeline, knobs.timeline_mark_cycles) == (str(tmp_path / "t.json"), True)
    assert (knobs.stall_check_disable, knobs.stall_check_time_seconds, knobs.stall_shutdown_time_seconds) == (
        True, 5.0, 30.0)
    assert (knobs.fusion_threshold, knobs.cycle_time, knobs.disable_cache) == (32 * 1024 * 1024, 2.5, True)
    assert (knobs.log_level, knobs.start_timeout, cfg.start_timeout) == ("DEBUG", 45.0, 45.0)
    assert knobs.hierarchical_allreduce
    assert cfg.command == (sys.executable, "-V") and cfg.np == 2


def test_x_sets_or_forwards_variables() -> None:
    cfg = _cfg(["-x", "A=1", "-x", "B", "-x", "C=x=y", sys.executable, "-V"], {"PATH": "/usr/bin", "B": "from-env"})
    assert cfg.env == {"A": "1", "B": "from-env", "C": "x=y"}


def test_np_defaults_to_the_hosts_slots() -> None:
    cfg = _cfg(["-H", "localhost:3", sys.executable, "-V"])
    assert (cfg.np, cfg.hosts, cfg.all_local) == (3, (HostSpec("localhost", 3),), True)


def test_config_file_flat_and_horovod_sections_and_command_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("np: 4\nhosts: localhost:4\nverbose: true\nx: [A=1]\n"
                    "params: {fusion_threshold_mb: 8}\ntimeline: {mark_cycles: true}\n"
                    "stall_check: {enabled: false, warning_time_seconds: 9}\nlogging: {level: info}\n")
    ns = parse_run_args(["--config-file", str(path), "-np", "2", sys.executable, "-V"])
    assert (ns.np, ns.hosts, ns.verbose, ns.x) == (2, "localhost:4", True, ["A=1"])
    assert (ns.fusion_threshold_mb, ns.timeline_mark_cycles, ns.no_stall_check) == (8.0, True, True)
    assert (ns.stall_check_warning_time_seconds, ns.log_level) == (9.0, "INFO")


def test_forwarded_environment_drops_host_specific_and_rank_variables() -> None:
    environ = {"PATH": "/p", "HOME": "/h", "MY_SETTING": "1", "CUDA_VISIBLE_DEVICES": "0,1", "HOSTNAME": "login1",
               "SSH_CONNECTION": "x", "BASH_FUNC_module%%": "() {}", "DISPLAY": ":0", "RANK": "5",
               "HOROVOD_RANK": "5", "SLURM_PROCID": "3", "PWD": "/x"}
    env = envvars.forwarded(environ, {"EXTRA": "2"})
    assert env == {"PATH": "/p", "HOME": "/h", "MY_SETTING": "1", "CUDA_VISIBLE_DEVICES": "0,1",
                   "PYTHONUNBUFFERED": "1", "EXTRA": "2"}


def test_rank_env_contract() -> None:
    slot = SlotInfo(rank=5, size=8, local_rank=1, local_size=4, cross_rank=1, cross_size=2, hostname="n2",
                    host_index=1)
    env = envvars.rank_env(slot, store_addr="10.0.0.1", store_port=1234, job_id="j1")
    assert {k: env[k] for k in ("HORA_RANK", "HORA_SIZE", "HORA_LOCAL_RANK", "HORA_LOCAL_SIZE", "HORA_CROSS_RANK",
                                "HORA_CROSS_SIZE", "HORA_HOSTNAME", "HORA_HOST_KEY", "HORA_STORE_ADDR",
                                "HORA_STORE_PORT", "HORA_JOB_ID")} == {
        "HORA_RANK": "5", "HORA_SIZE": "8", "HORA_LOCAL_RANK": "1", "HORA_LOCAL_SIZE": "4", "HORA_CROSS_RANK": "1",
        "HORA_CROSS_SIZE": "2", "HORA_HOSTNAME": "n2", "HORA_HOST_KEY": "n2", "HORA_STORE_ADDR": "10.0.0.1",
        "HORA_STORE_PORT": "1234", "HORA_JOB_ID": "j1"}
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"],
            env["MASTER_PORT"]) == ("5", "1", "8", "4", "10.0.0.1", "1234")
    assert (env["HOROVOD_RANK"], env["HOROVOD_CROSS_SIZE"], env["HOROVOD_HOSTNAME"]) == ("5", "2", "n2")


def test_user_ssh_options_come_before_hora_defaults_so_they_win() -> None:
    argv = SshTransport(options=("ConnectTimeout=99", "ServerAliveInterval=2")).ssh_prefix("h")
    assert argv.index("ConnectTimeout=99") < argv.index("ConnectTimeout=10")
    assert argv.index("ServerAliveInterval=2") < argv.index("ServerAliveInterval=5")


def test_heartbeat_timeout_flag_sets_the_agents_deadline_and_ssh_keepalive() -> None:
    cfg = _cfg(["-np", "1", "--heartbeat-timeout", "9", sys.executable, "-V"])
    assert cfg.heartbeat_timeout == 9.0
    from hora.launcher.remote.agent_handle import default_transport

    ssh = default_transport(cfg)("remote", False)
    assert isinstance(ssh, SshTransport) and ssh.alive_interval == 3


def test_grace_period_fits_schedulers_and_is_set_by_flag_or_environment() -> None:
    argv = ["-np", "1", sys.executable, "-V"]
    default = _cfg(argv)
    assert default.grace == run_config.DEFAULT_GRACE == 25.0  # under Kubernetes' and Slurm's 30 s
    assert _cfg(argv, {"PATH": "/usr/bin", "HORA_GRACE_PERIOD": "40"}).grace == 40.0
    assert _cfg(["--grace-period", "3", *argv], {"PATH": "/usr/bin", "HORA_GRACE_PERIOD": "40"}).grace == 3.0
    with pytest.raises(ConfigError, match=r"HORA_GRACE_PERIOD='soon': not a number of seconds"):
        _cfg(argv, {"PATH": "/usr/bin", "HORA_GRACE_PERIOD": "soon"})
    with pytest.raises(ConfigError, match=r"--grace-period -1: must be 0 or more seconds"):
        _cfg(["--grace-period", "-1", *argv])


def test_ssh_command_line_is_batch_mode_with_port_key_and_options() -> None:
    ssh = SshTransport(port=2222, identity_file="/keys/id", options=("StrictHostKeyChecking=no",),
                       config_file="/keys/cfg", connect_timeout=7)
    assert ssh.command("10.78.0.3", ["python", "-c", "print('a b')"], cwd="/work dir") == [
        "ssh", "-o", "BatchMode=yes", "-F", "/keys/cfg", "-p", "2222", "-i", "/keys/id",
        "-o", "StrictHostKeyChecking=no", "-o", "ConnectTimeout=7", "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3", "10.78.0.3",
        "cd '/work dir' 2>/dev/null; exec python -c 'print('\"'\"'a b'\"'\"')'"]
    assert ssh.command("[fe80::1]", ["true"])[-2:] == ["fe80::1", "exec true"]


def test_timeline_directory_is_created_if_missing(tmp_path: Path) -> None:
    """docs/diagnostics.md: the timeline's directory is created if missing, on the launcher host too."""
    path = tmp_path / "runs" / "today" / "t.json"
    cfg = _cfg(["-np", "1", "--timeline-filename", str(path), sys.executable, "-V"])
    assert cfg.timeline_filename == str(path) and path.parent.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(run_config.ConfigError, match="is not a directory"):
        _cfg(["-np", "1", "--timeline-filename", str(tmp_path / "file" / "t.json"), sys.executable, "-V"])


def test_elastic_flags_make_an_elastic_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    cfg = _cfg(["--min-num-proc", "2", "--max-num-proc", "6", "-np", "4", "-H", "a:2,b:2,c:2", "--reset-limit", "3",
                "--blacklist-cooldown-range", "10", "100", "python", "t.py"], {"HOROVOD_ELASTIC_TIMEOUT": "90"})
    assert cfg.elastic is not None and cfg.np == 4
    assert (cfg.elastic.min_np, cfg.elastic.max_np, cfg.elastic.reset_limit) == (2, 6, 3)
    assert cfg.elastic.cooldown == (10.0, 100.0) and cfg.elastic.elastic_timeout == 90.0  # from the environment
    assert cfg.elastic.discovery_script is None and [h.name for h in cfg.hosts] == ["a", "b", "c"]
    cfg = _cfg(["--host-discovery-script", "./d.sh", "--slots-per-host", "4", "--elastic-timeout", "30",
                "python", "t.py"], {"HOROVOD_ELASTIC_TIMEOUT": "90"})
    assert cfg.elastic is not None and cfg.elastic.discovery_script == "./d.sh"
    assert (cfg.np, cfg.elastic.min_np, cfg.elastic.slots_per_host, cfg.elastic.elastic_timeout) == (1, 1, 4, 30.0)
    assert _cfg(["-np", "2", sys.executable, "t.py"]).elastic is None


def test_horovodrun_autotune_and_library_flags_become_worker_knobs(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(["-np", "2", "--autotune", "--autotune-log-file", "at.csv", "--autotune-warmup-samples", "1",
                "--autotune-steps-per-sample", "4", "--autotune-bayes-opt-max-samples", "6",
                "--autotune-gaussian-process-noise", "0.5", "--no-hierarchical-allreduce", "--cache-capacity", "1024",
                "--gloo-timeout-seconds", "40", "--tcp", "--thread-affinity", "0,1", "--log-with-timestamp",
                "--stall-check", sys.executable, "-V"])
    knobs = Knobs.from_environ(cfg.env)
    assert (knobs.autotune, knobs.autotune_log) == (True, str(tmp_path / "at.csv"))
    assert (knobs.autotune_warmup_samples, knobs.autotune_steps_per_sample, knobs.autotune_bayes_opt_max_samples,
            knobs.autotune_gaussian_process_noise) == (1, 4, 6, 0.5)
    # given explicitly, so autotune holds them: hierarchical allreduce off, the cache on
    assert (knobs.hierarchical_allreduce, knobs.disable_cache) == (False, False)
    assert {"hierarchical_allreduce", "disable_cache", "autotune"} <= knobs.explicit
    assert "fusion_threshold" not in knobs.explicit
    assert (knobs.start_timeout, knobs.thread_affinity, knobs.log_hide_time) == (40.0, "0,1", False)
    assert not knobs.stall_check_disable
    assert cfg.env["NCCL_IB_DISABLE"] == "1"  # horovodrun --tcp


def test_start_timeout_wins_over_gloo_timeout() -> None:
    cfg = _cfg(["--gloo-timeout-seconds", "40", "--start-timeout", "50", sys.executable, "-V"])
    assert Knobs.from_environ(cfg.env).start_timeout == 50.0


@pytest.mark.parametrize(("argv", "message"), [
    (["--autotune-gaussian-process-noise", "1.5"], "must be in \\[0, 1\\]"),
    (["--autotune-steps-per-sample", "0"], "at least 1"),
    (["--cache-capacity", "-1"], "must not be negative"),
    (["--thread-affinity", "a,b"], "give a core number"),
])
def test_bad_horovodrun_values_are_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg([*argv, sys.executable, "-V"])


def test_flags_without_a_mechanism_each_print_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    from hora.launcher.cli import NO_MECHANISM, no_mechanism_notes

    ns = parse_run_args(["--num-nccl-streams", "2", "--no-hierarchical-allgather", "--torus-allreduce",
                         "--disable-cache", "--binding-args=--bind-to none", "--mpi-threads-disable",
                         sys.executable, "-V", "--num-nccl-streams"])
    notes = no_mechanism_notes(ns)
    assert [n.split(" ", 1)[0] for n in notes] == ["--disable-cache", "--no-hierarchical-allgather",
                                                    "--torus-allreduce", "--mpi-threads-disable", "--binding-args",
                                                    "--num-nccl-streams"]
    assert all("has no effect:" in n for n in notes)
    assert ns.command == [sys.executable, "-V", "--num-nccl-streams"]  # the script's own flags are its own
    given = {names[0] for names, _, _ in NO_MECHANISM}
    assert not no_mechanism_notes(parse_run_args([sys.executable, "-V"])) and len(given) == len(NO_MECHANISM)


def test_config_file_reads_horovods_autotune_library_and_controller_sections(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("controller: gloo\nparams: {cache_capacity: 0, hierarchical_allreduce: false}\n"
                    "autotune: {enabled: true, warmup_samples: 2, steps_per_sample: 5, log_file: a.csv}\n"
                    "library_options: {num_nccl_streams: 2, thread_affinity: '3', gloo_timeout_seconds: 9}\n"
                    "logging: {with_timestamp: true}\n")
    ns = parse_run_args(["--config-file", str(path), "--autotune-warmup-samples", "1", sys.executable, "-V"])
    assert (ns.gloo, ns.cache_capacity, ns.hierarchical_allreduce) == (True, 0, False)
    assert (ns.autotune, ns.autotune_warmup_samples, ns.autotune_steps_per_sample) == (True, 1, 5)
    assert (ns.num_nccl_streams, ns.thread_affinity, ns.gloo_timeout_seconds, ns.log_with_timestamp) == (
        2, "3", 9.0, True)


def test_every_horovodrun_flag_is_accepted() -> None:
    """Every option string of horovodrun 0.28.1's parser (horovod/runner/launch.py in its sdist) parses."""
    import ast

    from tests.horovod_sdist import horovod_sdist

    tree = ast.parse((horovod_sdist() / "horovod" / "runner" / "launch.py").read_text())
    parse_args = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
    flags = sorted({a.value for call in ast.walk(parse_args) if isinstance(call, ast.Call)
                    and getattr(call.func, "attr", "") == "add_argument"
                    for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")})
    assert len(flags) > 70, flags  # the parser was found and read
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    assert [f for f in flags if f not in ours] == []
    parser = build_parser()
    takes_value = {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}
    for flag in flags:
        if flag in ("-h", "--help", "-v", "--version", "-cb", "--check-build", "--config-file"):
            continue  # they exit, or read a file (tested above)
        values = {"--blacklist-cooldown-range": ["2", "3"], "--log-level": ["INFO"]}
        argv = [flag] + values.get(flag, ["1"] if takes_value[flag] else [])
        parse_run_args([*argv, sys.executable, "-V"])  # raises ConfigError for a flag it does not take
