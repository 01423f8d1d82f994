"""The ``hora`` command: ``hora run ...`` (and other subcommands, registered in :data:`SUBCOMMANDS`).

``hora run`` takes horovodrun's flags with their meanings (docs/horovod-differences.md); a few of hora's own are added
(``-x``, ``--ssh-option``, ``--ssh-config-file``). Usage errors are one line and exit code 2, with a
"Did you mean ...?" for a mistyped flag.

Example:
    $ hora run -np 4 -H node1:2,node2:2 python train.py
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from hora.errors import ConfigError, HoraError
from hora.launcher import config as run_config
from hora.launcher import output
from hora.launcher.config_file import load_config_file
from hora.launcher.elastic.driver import ElasticDriver
from hora.launcher.fixed.driver import Driver
from hora.launcher.remote.preflight import hora_version

log = logging.getLogger(__name__)

# name -> "module:function"; the function takes the argv after the subcommand and returns an exit code.
# Adding a subcommand is one line here.
SUBCOMMANDS: dict[str, str] = {
    "run": "hora.launcher.cli:run_main",
    "check": "hora.launcher.check:main",
    "bench": "hora.bench.cli:main",
    "secret": "hora.protocol.jobsecret:main",
}
USAGE_EXIT = 2
# name -> what `hora --help` says about it (a subcommand without an entry is listed without one)
DESCRIPTIONS: dict[str, str] = {
    "run": "run a training script on N processes, on this machine or several (horovodrun's flags)",
    "check": "show what this machine (or every host of -H/--hostfile) supports and whether versions agree",
    "bench": "measure the hosts: allreduce bandwidth, a model's throughput and scaling (under hora run)",
    "secret": "write a new job secret file for torchrun, srun, mpirun or Kubernetes (hora run makes its own)",
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one-line :class:`ConfigError`s instead of usage dumps."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message.replace("argument ", "", 1))


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--num-proc", dest="np", type=int,
                   help="number of worker processes (default: every slot of -H/--hostfile, else 1)")
    p.add_argument("-H", "--hosts", help="hosts and slots: host1:2,host2:2 (default localhost:np)")
    p.add_argument("-hostfile", "--hostfile", dest="hostfile", help="file of 'host slots=N' (or 'host:N') lines")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port on every host")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key")
    p.add_argument("--ssh-option", action="append", metavar="OPTION",
                   help="extra ssh -o option, e.g. StrictHostKeyChecking=no (repeatable)")
    p.add_argument("--ssh-config-file", help="ssh config file (ssh -F)")
    p.add_argument("--network-interface", "--network-interfaces", dest="network_interfaces", action="append",
                   help="interface(s) for the store and Gloo/NCCL traffic, e.g. eth0")
    p.add_argument("--start-timeout", type=float,
                   help="seconds for preflight and starting the agents (default 30), and for every rank to reach "
                        "hvd.init() (default 60)")
    p.add_argument("--heartbeat-timeout", type=float,
                   help="seconds of silence from the launcher (a dead link) before a host stops its workers "
                        "(default 30)")
    p.add_argument("--grace-period", type=float, metavar="SECONDS",
                   help="seconds a stopped rank gets between SIGTERM and SIGKILL (default 25, or HORA_GRACE_PERIOD; "
                        "keep it below your scheduler's: Kubernetes' terminationGracePeriodSeconds, Slurm's KillWait)")
    p.add_argument("--output-filename", help="write DIR/rank.N/stdout and stderr")
    p.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                   action="store_true", default=None,
                   help="prefix each output line with the time")
    p.add_argument("-x", action="append", metavar="NAME[=VALUE]", help="set/forward a worker env variable")
    p.add_argument("--verbose", action="store_true", default=None, help="say what the launcher does")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "TRACE"],
                   type=str.upper, help="log level of the launcher and of hora in workers")
    p.add_argument("--config-file", help="YAML file of flag values (the command line wins)")
    p.add_argument("-cb", "--check-build", action="store_true", default=None,
                   help="show what this hora build supports and exit")


# horovodrun 0.28.1 flags hora has no mechanism for: (option strings, argparse keywords, the one-line note
# `hora run` prints when one is given). Accepted so a horovodrun command line runs; never silently.
NO_MECHANISM: tuple[tuple[tuple[str, ...], dict[str, Any], str], ...] = (
    (("--disable-cache",), {"action": "store_true"},
     "hora run checks every host at every launch; it keeps no cache of earlier checks to disable "
     "(the response cache is --cache-capacity 0)"),
    (("--hierarchical-allgather",), {"dest": "hierarchical_allgather", "action": "store_true"},
     "hora has no hierarchical allgather: an allgather is one collective on its process set's group"),
    (("--no-hierarchical-allgather",), {"dest": "hierarchical_allgather", "action": "store_false"},
     "hora has no hierarchical allgather to turn off"),
    (("--torus-allreduce",), {"dest": "torus_allreduce", "action": "store_true"},
     "hora has no NCCL torus allreduce; --hierarchical-allreduce is the nearest"),
    (("--no-torus-allreduce",), {"dest": "torus_allreduce", "action": "store_false"},
     "hora has no torus allreduce to turn off"),
    (("--mpi-threads-disable",), {"dest": "mpi_threads_disable", "action": "store_true"},
     "hora has no MPI controller"),
    (("--no-mpi-threads-disable",), {"dest": "mpi_threads_disable", "action": "store_false"},
     "hora has no MPI controller"),
    (("--binding-args",), {"metavar": "ARGS"},
     "process binding is mpirun's (Spectrum MPI); hora starts ranks itself and binds none"),
    (("--num-nccl-streams",), {"type": int, "metavar": "N"},
     "hora issues every GPU collective of a rank on one launch stream"),
)


def _add_horovod_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--version", action="version", version=f"hora {hora_version()} (horovodrun 0.28.1's flags)",
                   help="print hora's version and exit")
    p.add_argument("--gloo", action="store_true", default=None, help="accepted: Gloo is hora's only controller")
    p.add_argument("--mpi", action="store_true", default=None, help="not supported (fails with a reason)")
    p.add_argument("--mpi-args", help="not supported (fails with a reason)")
    p.add_argument("--jsrun", action="store_true", default=None, help="not supported (fails with a reason)")
    p.add_argument("--cache-capacity", type=int, metavar="N",
                   help="0 turns the negotiation response cache off; any other value keeps it on (hora's holds "
                        "the first 4096 distinct requests)")
    p.add_argument("--hierarchical-allreduce", dest="hierarchical_allreduce", action="store_true", default=None,
                   help="reduce within each host, allreduce across hosts, share the result within the host")
    p.add_argument("--no-hierarchical-allreduce", dest="hierarchical_allreduce", action="store_false", default=None,
                   help="flat allreduce, held constant by --autotune")
    p.add_argument("--fusion-threshold-mb", type=float, help="fusion buffer size in MB")
    p.add_argument("--cycle-time-ms", type=float, help="accepted; hora negotiates on demand")
    p.add_argument("--timeline-filename", help="write a Chrome-trace timeline of every rank")
    p.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles", action="store_true", default=None,
                   help="mark negotiation rounds")
    p.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_false", default=None,
                   help="do not mark negotiation rounds (the default)")
    p.add_argument("--no-stall-check", dest="no_stall_check", action="store_true", default=None,
                   help="turn the stall inspector off")
    p.add_argument("--stall-check", dest="no_stall_check", action="store_false", default=None,
                   help="keep the stall inspector on (the default)")
    p.add_argument("--stall-check-warning-time-seconds", type=float, help="stall report after (default 60)")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float, help="stop a stalled job after (0=never)")
    p.add_argument("--gloo-timeout-seconds", type=float, metavar="SECONDS",
                   help="seconds init() waits for every rank and hora's Gloo groups connect (--start-timeout wins)")
    p.add_argument("--tcp", action="store_true", default=None,
                   help="TCP only: NCCL_IB_DISABLE=1 in every worker, as horovodrun")
    p.add_argument("--thread-affinity", metavar="CORES",
                   help="comma-separated cores, one per local rank, to pin each rank's negotiator thread to")
    p.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                   action="store_true", default=None, help="start hora's warning lines in workers with the time")
    p.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                   action="store_false", default=None, help="hora's warning lines carry no time (the default)")
    a = p.add_argument_group("autotune (docs/performance.md)")
    a.add_argument("--autotune", dest="autotune", action="store_true", default=None,
                   help="tune bucket size, fusion threshold and hierarchical allreduce on the first steps, keep the "
                        "best; flags given explicitly are held constant")
    a.add_argument("--no-autotune", dest="autotune", action="store_false", default=None, help="no autotune (default)")
    a.add_argument("--autotune-log-file", metavar="FILE", help="CSV of each sample (Horovod's columns); last row: best")
    a.add_argument("--autotune-warmup-samples", type=int, metavar="N", help="samples discarded first (default 3)")
    a.add_argument("--autotune-steps-per-sample", type=int, metavar="N", help="steps in one sample (default 10)")
    a.add_argument("--autotune-bayes-opt-max-samples", type=int, metavar="N",
                   help="samples of the Bayesian search (default 20)")
    a.add_argument("--autotune-gaussian-process-noise", type=float, metavar="ALPHA",
                   help="noise the Gaussian process assumes, in [0, 1] (default 0.8)")
    n = p.add_argument_group("horovodrun flags with no effect in hora (each prints why)")
    for names, kwargs, _ in NO_MECHANISM:
        n.add_argument(*names, **{"default": None, **kwargs, "help": "no effect in hora: see the note it prints"})
    e = p.add_argument_group("elastic (docs/elastic.md)")
    e.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                   help="elastic: fewest workers to run with (below it, wait up to --elastic-timeout)")
    e.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, help="elastic: most workers to run")
    e.add_argument("--slots-per-host", type=int, help="elastic: slots of a discovered host printed without :slots")
    e.add_argument("--host-discovery-script", metavar="SCRIPT",
                   help="elastic: prints the available hosts ('host' or 'host:slots' lines); run every second")
    e.add_argument("--elastic-timeout", type=float,
                   help="elastic: seconds to wait for --min-np slots or for a reset (default 600, "
                        "or HOROVOD_ELASTIC_TIMEOUT)")
    e.add_argument("--reset-limit", type=int, help="elastic: fail the job after more than this many resets")
    e.add_argument("--blacklist-cooldown-range", nargs=2, type=float, metavar=("MIN", "MAX"),
                   help="elastic: a failed host comes back after MIN..MAX seconds (doubling per failure); "
                        "default: blacklisted for good")


def no_mechanism_notes(ns: argparse.Namespace) -> list[str]:
    """One line per :data:`NO_MECHANISM` flag given (on the command line or in --config-file): what it would do
    in Horovod has no counterpart in hora, and why."""
    notes = []
    for names, kwargs, note in NO_MECHANISM:
        dest = kwargs.get("dest", names[0].lstrip("-").replace("-", "_"))
        value = getattr(ns, dest, None)
        action = kwargs.get("action")
        given = value is True if action == "store_true" else value is False if action == "store_false" \
            else value is not None
        if given:
            notes.append(f"{names[0]} has no effect: {note}")
    return notes


def build_parser() -> argparse.ArgumentParser:
    """The ``hora run`` parser (every default is None so a config file can fill what is unset)."""
    p = _Parser(prog="hora run", allow_abbrev=False, description="Run a command on every rank.",
                usage="hora run [flags] -np N [-H host:slots,...] command [args...]")
    _add_launch_flags(p)
    _add_horovod_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    return p


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings]


def _unknown_flag(parser: argparse.ArgumentParser, flag: str) -> ConfigError:
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, _option_strings(parser), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]}?" if close else " See hora run --help."
    return ConfigError(f"unknown flag {name}.{hint}")


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``hora run`` flags, filling unset ones from ``--config-file``."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise _unknown_flag(parser, unknown[0])
    if ns.config_file:
        values = load_config_file(ns.config_file, parser)
        for dest, value in values.items():
            if getattr(ns, dest) is None:
                setattr(ns, dest, value)
    return ns


def _setup_logging(ns: argparse.Namespace) -> None:
    level = ns.log_level or ("INFO" if ns.verbose else "WARNING")
    level = "DEBUG" if level == "TRACE" else level
    logging.basicConfig(level=level, format="hora run: %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def run_main(argv: Sequence[str]) -> int:
    """``hora run``: parse, check, launch; return the job's exit code."""
    try:
        ns = parse_run_args(argv)
        _setup_logging(ns)
        for note in no_mechanism_notes(ns):
            output.note(note)
        if ns.check_build:
            return _check_build()
        cfg = run_config.from_args(ns)
        if cfg.elastic is not None:
            return ElasticDriver(cfg).run()
        return Driver(cfg).run()
    except HoraError as exc:  # a usage or setup error (2), or the job's failure: the type carries the code
        output.error_line("hora run", str(exc))
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before any worker started (preflight, store)
        output.error_line("hora run", "interrupted before the job started; nothing is running")
        return 130


def _check_build() -> int:
    """``--check-build``: ``hora check`` on this machine (Horovod's block is part of its table)."""
    return int(_load(SUBCOMMANDS["check"])([]))


def _load(target: str) -> Callable[[list[str]], Any]:
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]


def _usage() -> str:
    return "usage: hora {" + ",".join(SUBCOMMANDS) + "} ...   (hora run --help for the launcher's flags)"


def _help() -> str:
    """``hora --help``: what each command does, and where to start."""
    width = max(len(name) for name in SUBCOMMANDS) + 2
    commands = "\n".join(f"  {name:<{width}}{DESCRIPTIONS.get(name, '')}".rstrip() for name in SUBCOMMANDS)
    return (f"{_usage()}\n\nhora: Horovod's API and launcher on torch.distributed.\n\ncommands:\n{commands}\n\n"
            "hora COMMAND --help shows a command's flags. Examples:\n"
            "  hora run -np 4 python train.py                      4 processes on this machine\n"
            "  hora run -np 8 -H node1:4,node2:4 python train.py   2 machines over ssh\n"
            "  hora check                                          this machine's build and versions\n"
            "hora --version prints the version.")


def main(argv: Sequence[str] | None = None) -> int:
    """The ``hora`` console entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        output.line(_help() if args else _usage())
        return 0 if args else USAGE_EXIT
    if args[0] == "--version":
        output.line(f"hora {hora_version()}")
        return 0
    if args[0].startswith("-"):  # horovodrun habit: `hora -np 2 python train.py` means `hora run ...`
        args.insert(0, "run")
    name = args[0]
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        output.error_line("hora", f"unknown command {name!r}.{hint} {_usage()}")
        return USAGE_EXIT
    return int(_load(SUBCOMMANDS[name])(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
