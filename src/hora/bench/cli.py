"""The ``hora bench`` command (also ``python -m hora bench``).

``allreduce`` and ``model`` measure, so they run on every rank under ``hora run`` (alone they run as one
rank); rank 0 prints a Markdown table on stdout and writes ``--json`` and ``--plot``. ``plan`` reads a
sweep's JSON and predicts; it needs no ranks. ``control`` runs alone: it forks its ranks on this machine
(:mod:`hora.bench.control`) and projects to larger jobs (:mod:`hora.bench.projection`).

Example:
    hora run -np 4 -H a:2,b:2 hora bench allreduce --sizes 1KB..256MB --json sweep.json --plot sweep.png
    hora run -np 4 -H a:2,b:2 hora bench model --model resnet50 --batch-size 32 --json model.json
    hora bench plan --sweep sweep.json --model-bytes 100MB --hosts 2,4,8 --compute-ms 250
    hora bench control --ranks 8,16,32,64,128 --sweep sweep.json --json control.json --plot control.png
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hora as hvd
from hora.bench import model, planner, sweep
from hora.bench.report import parse_size, parse_sizes, write_json, write_plot
from hora.errors import ConfigError, HoraError
from hora.launcher import output
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)

USAGE_EXIT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message.replace("argument ", "", 1))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 1,2,4") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hora bench", description="Measure a cluster with hora. allreduce and model run on every rank: "
                "start them under hora run (hora run -np 4 -H a:2,b:2 hora bench allreduce); alone they run as "
                "one rank. plan needs no ranks.")
    sub = p.add_subparsers(dest="what", required=True, parser_class=_Parser)
    common = _Parser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="write the full record (every sample) as JSON")
    common.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    common.add_argument("--repeats", type=int, default=5, help="alternation cycles (default 5)")
    common.add_argument("--compression", choices=sorted(sweep.COMPRESSIONS), default="none",
                        help="hora's gradient compression (default none)")

    a = sub.add_parser("allreduce", parents=[common], help="allreduce sweep: algbw/busbw, hora against raw",
                       description="Time hora's allreduce against raw torch.distributed for each message size, "
                       "alternating the two, and print algbw/busbw and hora's speed relative to raw. Run it under "
                       "hora run, e.g. hora run -np 4 -H a:2,b:2 hora bench allreduce (alone it is one rank and "
                       "measures no communication). The defaults (1KB..256MB: 10 sizes, 5 cycles of 0.2 s "
                       "samples) take about a minute.")
    a.add_argument("--sizes", default="1KB..256MB",
                   help="a range lo..hi (every 4th power of two between, both ends) or a list: 1MB,16MB "
                        "(default 1KB..256MB: 1KB, 4KB, 16KB, ... 64MB, 256MB)")
    a.add_argument("--dtype", choices=sorted(sweep.DTYPES), default="float32")
    a.add_argument("--sample-seconds", type=float, default=0.2, help="length of one timed sample (default 0.2)")
    a.add_argument("--no-links", action="store_true", help="skip the per-link-type (intra/inter host) sweep")

    gpu, cpu_ = model.defaults_for("cuda"), model.defaults_for("cpu")
    m = sub.add_parser("model", parents=[common], help="synthetic training throughput and scaling efficiency",
                       description="Train a model on random data on 1, 2, 4 ... ranks and print throughput and "
                       "scaling efficiency against one rank. Run it under hora run, e.g. hora run -np 4 hora bench "
                       f"model. Each rank trains on its GPU where it has one, else on the CPU. The defaults, sized "
                       f"to finish in about two minutes on a quiet machine (longer under load): {gpu[0]} at "
                       f"{gpu[1]} px, batch {gpu[2]} per rank on GPUs; {cpu_[0]} at {cpu_[1]} px, batch {cpu_[2]} "
                       "on CPUs.")
    m.add_argument("--model", default=None,
                   help=f"mlp, wide-mlp, resnet18, resnet50 (built in) or a torchvision.models name (default "
                        f"{gpu[0]} on GPUs, {cpu_[0]} on CPUs)")
    m.add_argument("--batch-size", type=int, default=None,
                   help=f"per rank (default {gpu[2]} on GPUs, {cpu_[2]} on CPUs)")
    m.add_argument("--image-size", type=int, default=None,
                   help=f"synthetic image side (default {gpu[1]} on GPUs, {cpu_[1]} on CPUs)")
    m.add_argument("--np-list", type=_ints, help="rank counts to compare, e.g. 1,2,4 (default 1,2,4..size)")
    m.add_argument("--steps", type=int, default=5, help="timed steps per sample (default 5)")

    pl = sub.add_parser("plan", help="fit an alpha-beta model to a sweep and predict")
    pl.add_argument("--sweep", required=True, metavar="JSON", help="the --json of hora bench allreduce")
    pl.add_argument("--model-bytes", default="100MB", help="gradient bytes per step (default 100MB: ResNet-50)")
    pl.add_argument("--hosts", type=_ints, default=[2, 4, 8], help="host counts to predict (default 2,4,8)")
    pl.add_argument("--ranks-per-host", type=int, default=1)
    pl.add_argument("--compute-ms", type=float, help="one rank's step time without sync (hora bench model, 1 rank)")
    pl.add_argument("--overlap", type=float, default=0.0, help="fraction of compute that hides sync (0..1)")
    pl.add_argument("--min-bytes", default="0", help="fit only sizes from this one up")
    pl.add_argument("--compression", choices=sorted(sweep.COMPRESSIONS), default="none",
                    help="predict hora's allreduce and step with this compression (default none)")
    pl.add_argument("--json", metavar="PATH", help="write the fit and predictions as JSON")

    c = sub.add_parser("control", help="how start-up and negotiation grow with the number of ranks: forks the "
                                       "ranks on this machine, counts, and projects to larger jobs")
    c.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64, 128], help="rank counts (default 8,16,32,64,128)")
    c.add_argument("--planes", default="tcp,gloo",
                   help="control planes to measure, of auto, tcp, gloo (default tcp,gloo: hora picks tcp at "
                        "every size)")
    c.add_argument("--ops", type=int, default=20, help="allreduces per rounds phase, cold then warm (default 20)")
    c.add_argument("--no-elastic", action="store_true", help="skip the elastic job (start and reset)")
    c.add_argument("--timeout", type=float, default=1800.0, help="seconds one job may take (default 1800)")
    c.add_argument("--sweep", metavar="JSON", help="the --json of hora bench allreduce: its alpha-beta fit times "
                                                   "the projection (without it: CPU time only)")
    c.add_argument("--min-bytes", default="0", help="fit the sweep's sizes from this one up")
    c.add_argument("--project", type=_ints, default=[1024, 4096], help="rank counts to project to")
    c.add_argument("--ranks-per-host", type=int, default=8, help="for the projection (default 8)")
    c.add_argument("--from", dest="source", metavar="JSON",
                   help="project from the --json of an earlier run instead of measuring")
    c.add_argument("--json", metavar="PATH", help="write the summaries, the counts rank by rank and the projection")
    c.add_argument("--plot", metavar="PATH", help="write a PNG plot of each quantity against n, log-log")
    return p


def _measure(ns: argparse.Namespace) -> tuple[dict[str, Any], Callable[[dict[str, Any]], str],
                                             Callable[[dict[str, Any]], Callable[[Any], None]]]:
    if ns.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    sizes = parse_sizes(ns.sizes) if ns.what == "allreduce" else []  # usage errors before any rendezvous
    hvd.init()
    if hvd.size() == 1 and hvd.rank() == 0:
        log.warning("hora bench runs on one rank: start it with hora run -np N to measure communication")
    if ns.what == "allreduce":
        cfg = sweep.SweepConfig(sizes=sizes, dtype=ns.dtype, compression=ns.compression,
                                repeats=ns.repeats, sample_s=ns.sample_seconds, links=not ns.no_links)
        return sweep.run(cfg), sweep.markdown, sweep.plot
    cfg_m = _model_config(ns, "cuda" if runtime.state().device is not None else "cpu")
    return model.run(cfg_m), model.markdown, model.plot


def _model_config(ns: argparse.Namespace, device: str) -> model.ModelConfig:
    """The model benchmark's settings: the flags given, the device's defaults for the rest (said on rank 0)."""
    name, image_size, batch = model.defaults_for(device)
    cfg = model.ModelConfig(model=ns.model or name, image_size=ns.image_size or image_size,
                            batch_size=ns.batch_size or batch, compression=ns.compression, np_list=ns.np_list or (),
                            steps=ns.steps, repeats=ns.repeats, device=device)
    defaulted = [flag for flag, given in (("--model", ns.model), ("--image-size", ns.image_size),
                                          ("--batch-size", ns.batch_size)) if given is None]
    if defaulted and hvd.rank() == 0:
        output.line(f"hora bench model: on {device}: {cfg.model}, {cfg.image_size} px images, batch "
                    f"{cfg.batch_size} per rank (the defaults for {device} are sized to finish in about two "
                    f"minutes on a quiet machine, longer on a loaded one; to change them: {', '.join(defaulted)})",
                    sys.stderr)
    return cfg


def _plan(ns: argparse.Namespace) -> int:
    try:
        data = json.loads(Path(ns.sweep).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--sweep {ns.sweep}: cannot read it as JSON ({e})") from None
    fit = planner.fit_sweep(data, min_bytes=parse_size(ns.min_bytes))
    grad = parse_size(ns.model_bytes)
    compute = ns.compute_ms / 1e3 if ns.compute_ms is not None else None
    rows = planner.predictions(fit, grad, ns.hosts, ns.ranks_per_host, compute, ns.overlap, ns.compression)
    output.line(planner.markdown(fit, rows, grad).rstrip("\n"))
    if ns.json:
        write_json(ns.json, {"kind": "plan", "fit": planner.as_dict(fit), "gradient_bytes": grad, "rows": rows})
    return 0


def _control(ns: argparse.Namespace) -> int:
    from hora.bench import control, control_report, projection  # forks ranks: imported only for this command

    plan = None
    if ns.sweep:
        try:
            sweep_data = json.loads(Path(ns.sweep).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--sweep {ns.sweep}: cannot read it as JSON ({e})") from None
        plan = planner.fit_sweep(sweep_data, min_bytes=parse_size(ns.min_bytes))
    if ns.source:
        try:
            record = json.loads(Path(ns.source).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--from {ns.source}: cannot read it as JSON ({e})") from None
        if record.get("kind") != "control":
            raise ConfigError(f"--from {ns.source}: not the JSON of hora bench control")
    else:
        cfg = control.ControlConfig(ranks=tuple(ns.ranks), planes=tuple(p.strip() for p in ns.planes.split(",")),
                                    ops=ns.ops, elastic=not ns.no_elastic, timeout_s=ns.timeout)
        record = control.measure(cfg, progress=lambda line: output.line(f"hora bench control: {line}", sys.stderr))
    record["projection"] = projection.project(record, plan, ns.project, ns.ranks_per_host)
    output.line(control_report.markdown(record).rstrip("\n"))
    output.line("")
    output.line(projection.markdown(record["projection"]).rstrip("\n"))
    if ns.json:
        write_json(ns.json, control_report.compact(record))
    if ns.plot:
        write_plot(ns.plot, control_report.plot(record), size=(15, 8.5))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``hora bench``; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="hora bench: %(levelname)s %(message)s", stream=sys.stderr)
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if ns.what == "plan":
            return _plan(ns)
        if ns.what == "control":
            return _control(ns)
        result, to_markdown, to_plot = _measure(ns)
        if hvd.rank() == 0:
            output.line(to_markdown(result).rstrip("\n"))
            if ns.json:
                write_json(ns.json, result)
            if ns.plot:
                write_plot(ns.plot, to_plot(result))
        hvd.shutdown()
        return 0
    except ConfigError as exc:
        output.error_line("hora bench", str(exc))
        return USAGE_EXIT
    except HoraError as exc:
        output.error_line("hora bench", str(exc))
        return 1
